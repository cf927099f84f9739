//! The tier state a KV manager carries: L2 bookkeeping, the key of every cached L1 block, the
//! moves pending for the next step, swapped-out sequences, fetches in flight, and counters.
//!
//! Pending moves ([`TierOps`]) accumulate while the scheduler plans a step and leave with its
//! StepPlan (`drain`). A slot that changes hands while an offload into it is still pending
//! drops that offload, so no slot is written twice by one step and no move reads a slot that
//! was given away. Loads pin their cached source slot until the drain; a swapped-in sequence's
//! private slots are freed at the drain (the runner reads them before any later step writes).

use std::collections::{HashMap, HashSet};

use super::fetch::Fetch;
use super::host::{HostTier, SlotState};
use super::{chain_from_root, chain_key, BlockKey, TierConfig};
use crate::error::{KvError, KvResult};

/// Offload kinds (`TierOps::offload_kind`).
pub const OFFLOAD_CACHED: u8 = 1;
/// A swapped-out block of a preempted sequence (private slot, never written below L2).
pub const OFFLOAD_SWAP: u8 = 2;

/// One step's tier moves, as flat arrays (in the order the runner applies them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierOps {
    /// (L1 block, L4 key) of blocks to write through to L4: [n], [n] keys, [n * bs] tokens.
    pub publish: Vec<u32>,
    /// Keys of `publish`.
    pub publish_keys: Vec<BlockKey>,
    /// Token ids of `publish` (block_size each).
    pub publish_tokens: Vec<u32>,
    /// (L1 block, L2 slot) copies.
    pub offload: Vec<[u32; 2]>,
    /// `OFFLOAD_CACHED` or `OFFLOAD_SWAP` per offload.
    pub offload_kind: Vec<u8>,
    /// Key per offload (zeros for swaps).
    pub offload_keys: Vec<BlockKey>,
    /// Token ids per offload (block_size each; zeros for swaps).
    pub offload_tokens: Vec<u32>,
    /// (L2 slot, L1 block) copies.
    pub load: Vec<[u32; 2]>,
    /// KV ids of sequences that want blocks fetched from L3/L4.
    pub fetch_seqs: Vec<u64>,
    /// [len(fetch_seqs) + 1] offsets into `fetch_keys`.
    pub fetch_offsets: Vec<u32>,
    /// Keys to fetch, in chain order per sequence.
    pub fetch_keys: Vec<BlockKey>,
    /// Token ids of `fetch_keys` (block_size each), to compare with what is loaded.
    pub fetch_tokens: Vec<u32>,
}

impl TierOps {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.publish.is_empty()
            && self.offload.is_empty()
            && self.load.is_empty()
            && self.fetch_seqs.is_empty()
    }
}

/// A swapped-out sequence: its blocks' private L2 slots, in table order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swap {
    /// One private slot per block.
    pub slots: Vec<u32>,
    /// Computed tokens the slots hold.
    pub num_tokens: usize,
}

/// Tier counters since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Admitted prefix-hit tokens served from L1.
    pub l1_hit_tokens: u64,
    /// Admitted prefix-hit tokens loaded from L2 (fetched ones included).
    pub l2_hit_tokens: u64,
    /// Blocks offloaded L1 -> L2 on eviction.
    pub offloaded_blocks: u64,
    /// Evicted blocks L2 had no room for (dropped).
    pub offload_dropped: u64,
    /// Blocks loaded L2 -> L1 (swap-ins included).
    pub loaded_blocks: u64,
    /// Sequences swapped out / in.
    pub swap_outs: u64,
    /// Sequences swapped back in.
    pub swap_ins: u64,
    /// Blocks published to L4.
    pub published_blocks: u64,
    /// Fetch requests sent to L3/L4 / blocks that arrived.
    pub fetch_requests: u64,
    /// Blocks that arrived from L3/L4 into L2.
    pub fetched_blocks: u64,
    /// L2 slots evicted.
    pub host_evictions: u64,
}

/// Everything the KV manager knows about tiers below L1.
#[derive(Debug, Clone)]
pub struct Tiers {
    /// Configuration (costs updated by Python).
    pub cfg: TierConfig,
    /// L2 bookkeeping.
    pub host: HostTier,
    pub(super) block_size: usize,
    l1_key: Vec<Option<BlockKey>>,
    l1_tokens: Vec<u32>,
    pub(super) ops: TierOps,
    load_pins: Vec<u32>,
    free_after_drain: Vec<u32>,
    /// Swapped-out sequences by KV id.
    pub swaps: HashMap<u64, Swap>,
    pub(super) fetching: HashMap<u64, Fetch>,
    pub(super) probed: HashSet<u64>,
    published: HashSet<BlockKey>,
    pub(super) stats: TierStats,
}

/// Published keys remembered (to skip re-publishing) before the set is cleared.
const MAX_PUBLISHED: usize = 1 << 20;

impl Tiers {
    /// Tier state for a pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(cfg: TierConfig, num_blocks: u32, block_size: u32) -> Self {
        let (n, bs) = (num_blocks as usize, block_size as usize);
        Tiers {
            host: HostTier::new(cfg.host_blocks, block_size),
            cfg,
            block_size: bs,
            l1_key: vec![None; n],
            l1_tokens: vec![0; n * bs],
            ops: TierOps::default(),
            load_pins: Vec::new(),
            free_after_drain: Vec::new(),
            swaps: HashMap::new(),
            fetching: HashMap::new(),
            probed: HashSet::new(),
            published: HashSet::new(),
            stats: TierStats::default(),
        }
    }

    /// Counters (L2 evictions included).
    pub fn stats(&self) -> TierStats {
        TierStats {
            host_evictions: self.host.evictions,
            ..self.stats
        }
    }

    /// Mutable counters.
    pub fn stats_mut(&mut self) -> &mut TierStats {
        &mut self.stats
    }

    /// The chain key of cached L1 block `b`.
    pub fn key_of(&self, b: u32) -> Option<BlockKey> {
        self.l1_key[b as usize]
    }

    /// The key chain root.
    pub fn root(&self) -> BlockKey {
        self.cfg.root
    }

    /// L1 block `b` was cached holding `tokens` under key `key`; publishes it to L4 once.
    pub fn on_cached(&mut self, b: u32, key: BlockKey, tokens: &[u32]) {
        let bs = self.block_size;
        self.l1_key[b as usize] = Some(key);
        self.l1_tokens[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(tokens);
        if self.cfg.publish {
            if self.published.len() >= MAX_PUBLISHED {
                self.published.clear();
            }
            if self.published.insert(key) {
                self.ops.publish.push(b);
                self.ops.publish_keys.push(key);
                self.ops.publish_tokens.extend_from_slice(tokens);
                self.stats.published_blocks += 1;
            }
        }
    }

    /// L1 block `b` was just cached as the last full block of `tokens`, after `parent`.
    pub fn cache_block(&mut self, b: u32, parent: Option<u32>, ns: u64, tokens: &[u32]) {
        let bs = self.block_size;
        let i = tokens.len() / bs - 1;
        let pk = match parent.and_then(|p| self.key_of(p)) {
            Some(k) => k,
            None if parent.is_none() => self.root(),
            None => chain_from_root(self.root(), ns, &tokens[..i * bs], bs),
        };
        let key = chain_key(&pk, ns, &tokens[i * bs..]);
        self.on_cached(b, key, &tokens[i * bs..]);
    }

    /// L1 block `b` stopped being cached; `write_back`: copy it to L2 first (eviction). The L2
    /// slot that holds its KV now, if any.
    pub fn on_uncached(&mut self, b: u32, write_back: bool) -> Option<u32> {
        let key = self.l1_key[b as usize].take()?;
        if !write_back || self.cfg.host_blocks == 0 {
            return None;
        }
        let bs = self.block_size;
        let tokens = self.l1_tokens[b as usize * bs..(b as usize + 1) * bs].to_vec();
        match self.host.insert(key, &tokens) {
            Some((s, true)) => {
                self.retarget(s);
                self.ops.offload.push([b, s]);
                self.ops.offload_kind.push(OFFLOAD_CACHED);
                self.ops.offload_keys.push(key);
                self.ops.offload_tokens.extend_from_slice(&tokens);
                self.stats.offloaded_blocks += 1;
                Some(s)
            }
            Some((s, false)) => Some(s), // L2 already holds it (loaded earlier): nothing to copy
            None => {
                self.stats.offload_dropped += 1;
                None
            }
        }
    }

    /// Slot `s` was just taken for a new owner: a pending offload into it is void.
    fn retarget(&mut self, s: u32) {
        let bs = self.block_size;
        while let Some(i) = self.ops.offload.iter().position(|op| op[1] == s) {
            self.ops.offload.remove(i);
            self.ops.offload_kind.remove(i);
            self.ops.offload_keys.remove(i);
            self.ops.offload_tokens.drain(i * bs..(i + 1) * bs);
        }
    }

    /// Pins the L2 slots of a prefix hit.
    pub fn pin_hit(&mut self, slots: &[u32]) {
        for &s in slots {
            debug_assert!(matches!(self.host.state(s), SlotState::Cached(_)));
            self.host.pin(s);
        }
    }

    /// Releases the pins `pin_hit` took.
    pub fn unpin_all(&mut self, slots: &[u32]) {
        for &s in slots {
            self.host.unpin(s);
        }
    }

    /// Records loads `slots[i] -> blocks[i]`; the pins (cached slots) last until the drain.
    pub fn record_loads(&mut self, slots: &[u32], blocks: &[u32]) {
        for (&s, &b) in slots.iter().zip(blocks) {
            self.ops.load.push([s, b]);
            if matches!(self.host.state(s), SlotState::Cached(_)) {
                self.host.pin(s);
                self.load_pins.push(s);
            } else {
                self.free_after_drain.push(s);
            }
        }
        self.stats.loaded_blocks += slots.len() as u64;
    }

    /// Private slots for swapping out `blocks` of sequence `kv_id` (all or none).
    pub fn swap_out(&mut self, kv_id: u64, blocks: &[u32], num_tokens: usize) -> bool {
        let mut slots = Vec::with_capacity(blocks.len());
        for _ in blocks {
            match self.host.alloc_private(kv_id) {
                Some(s) => {
                    self.retarget(s);
                    slots.push(s);
                }
                None => {
                    slots.into_iter().for_each(|s| self.host.free_private(s));
                    return false;
                }
            }
        }
        let bs = self.block_size;
        for (&b, &s) in blocks.iter().zip(&slots) {
            self.ops.offload.push([b, s]);
            self.ops.offload_kind.push(OFFLOAD_SWAP);
            self.ops.offload_keys.push([0; 32]);
            self.ops.offload_tokens.extend(std::iter::repeat_n(0, bs));
        }
        self.swaps.insert(kv_id, Swap { slots, num_tokens });
        self.stats.swap_outs += 1;
        true
    }

    /// Hands the pending moves to `out` (cleared first) and releases their pins.
    pub fn drain(&mut self, out: &mut TierOps) {
        *out = std::mem::take(&mut self.ops);
        for s in self.load_pins.drain(..) {
            self.host.unpin(s);
        }
        for s in self.free_after_drain.drain(..) {
            self.host.free_private(s);
        }
    }

    /// Host invariants, swap slots private to their owner, pending offloads unique per slot.
    pub fn check_invariants(&self) -> KvResult<()> {
        self.host.check_invariants()?;
        let bad = |m: String| Err(KvError::Invariant(format!("tiers: {m}")));
        let mut owned = 0;
        for (&id, sw) in &self.swaps {
            for &s in &sw.slots {
                if self.host.state(s) != SlotState::Private(id) {
                    return bad(format!("swap slot {s} of {id} not private to it"));
                }
            }
            owned += sw.slots.len();
        }
        let private = (0..self.host.num_slots() as u32)
            .filter(|&s| matches!(self.host.state(s), SlotState::Private(_)))
            .count();
        if private != owned + self.free_after_drain.len() {
            return bad(format!("{private} private slots, {owned} owned by swaps"));
        }
        let mut slots: Vec<u32> = self.ops.offload.iter().map(|op| op[1]).collect();
        slots.sort_unstable();
        if slots.windows(2).any(|w| w[0] == w[1]) {
            return bad("two pending offloads into one slot".to_string());
        }
        Ok(())
    }
}
