//! Fetches from L3/L4: what a waiting sequence asked for, and where the blocks that arrived go.
//!
//! `start_fetch` records the keys (with their tokens) a sequence wants beyond its L1+L2 hit, and
//! the tokens before them; `fetched` puts the leading blocks that arrived into L2 slots and
//! returns them with the prefix path of each, so the KV manager can name every slot on its
//! entry in the prefix cache (one fetch per sequence: `probed`).

use super::state::Tiers;
use super::BlockKey;

#[derive(Debug, Clone)]
pub(super) struct Fetch {
    pub(super) keys: Vec<BlockKey>,
    pub(super) tokens: Vec<u32>,
    pub(super) ns: u64,
    /// The sequence's tokens before the fetched blocks (whole blocks).
    pub(super) prefix: Vec<u32>,
}

/// Fetched blocks that went into L2 slots: what the prefix cache should name.
#[derive(Debug, Clone, Default)]
pub struct Fetched {
    /// Slot per arrived block, in order (`u32::MAX`: L2 held it already).
    pub slots: Vec<u32>,
    /// Namespace of the sequence.
    pub ns: u64,
    /// (slot, key, prefix tokens through that block) for every block in L2 now.
    pub attach: Vec<(u32, BlockKey, Vec<u32>)>,
}

impl Tiers {
    /// Asks L3/L4 for `keys` (with their tokens) on behalf of sequence `kv_id` in `ns`, whose
    /// tokens before them are `prefix`.
    pub fn start_fetch(
        &mut self,
        kv_id: u64,
        keys: Vec<BlockKey>,
        tokens: Vec<u32>,
        ns: u64,
        prefix: Vec<u32>,
    ) {
        if self.ops.fetch_offsets.is_empty() {
            self.ops.fetch_offsets.push(0);
        }
        self.ops.fetch_seqs.push(kv_id);
        self.ops.fetch_keys.extend_from_slice(&keys);
        self.ops.fetch_tokens.extend_from_slice(&tokens);
        self.ops
            .fetch_offsets
            .push(self.ops.fetch_keys.len() as u32);
        let f = Fetch {
            keys,
            tokens,
            ns,
            prefix,
        };
        self.fetching.insert(kv_id, f);
        self.stats.fetch_requests += 1;
    }

    /// Whether sequence `kv_id` was already asked for (one fetch per sequence).
    pub fn probed(&self, kv_id: u64) -> bool {
        self.probed.contains(&kv_id)
    }

    /// The first `count` blocks of `kv_id`'s fetch arrived: L2 slots to write them into, in
    /// order (`u32::MAX`: already cached, skip). Unknown or finished sequences get none.
    pub fn fetched(&mut self, kv_id: u64, count: usize) -> Fetched {
        let Some(f) = self.fetching.remove(&kv_id) else {
            return Fetched::default();
        };
        self.probed.insert(kv_id);
        let bs = self.block_size;
        let mut done = Fetched {
            ns: f.ns,
            ..Fetched::default()
        };
        let mut path = f.prefix;
        for (i, key) in f.keys.iter().enumerate().take(count) {
            let tokens = &f.tokens[i * bs..(i + 1) * bs];
            path.extend_from_slice(tokens);
            match self.host.insert(*key, tokens) {
                Some((s, fresh)) => {
                    done.slots.push(if fresh { s } else { u32::MAX });
                    done.attach.push((s, *key, path.clone()));
                }
                None => break,
            }
        }
        self.stats.fetched_blocks += done.slots.iter().filter(|&&s| s != u32::MAX).count() as u64;
        done
    }

    /// Whether sequence `kv_id` waits for a fetch.
    pub fn is_fetching(&self, kv_id: u64) -> bool {
        self.fetching.contains_key(&kv_id)
    }

    /// Sequence `kv_id` is gone (finished or aborted): its swap slots and fetch state go.
    pub fn forget(&mut self, kv_id: u64) {
        if let Some(sw) = self.swaps.remove(&kv_id) {
            sw.slots.into_iter().for_each(|s| self.host.free_private(s));
        }
        self.fetching.remove(&kv_id);
        self.probed.remove(&kv_id);
    }
}
