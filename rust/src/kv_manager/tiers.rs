//! The KV manager's side of the tiers: keys of cached blocks, write-back on eviction, prefix
//! lookups that continue below L1, admission with loads, swap-out, fetch requests.
//!
//! A tiered lookup is one walk of the prefix cache (`match_tiered`): entries whose block left L1
//! keep the L2 slot it was written back to, so the walk reports the L1 prefix (token
//! granularity) and the L2 slots of the full blocks after it. When L2 extends the hit, the hit
//! becomes the L1 full blocks plus fresh L1 blocks that load the L2 slots before the forward;
//! the loaded blocks re-attach to their entries once the step that loads them has run
//! (`cache_computed`). A swapped-out sequence is admitted the same way with its private slots
//! in place of L2 hits. Every call that can evict an L2 slot (write-back, fetch, swap-out)
//! then drops that slot from the prefix cache before the slot is named again, so an entry never
//! names a reused slot; blocks fetched from L3/L4 are named on their entries as they land.
//!
//! Costs: a lookup is the prefix cache's walk plus O(log L2 slots) per L2 hit (pins); the key
//! of the last full L1 block is computed (SHA-256) only for a fetch; eviction write-back is
//! O(log L2 slots) per evicted block.

use super::{blocks_for, KvManager, PrefixHit};
use crate::error::KvResult;
use crate::tiers::{
    chain_from_root, chain_key, BlockKey, SlotState, TierConfig, TierOps, TierStats, Tiers,
};

/// A prefix hit across L1 and L2 (or a swapped-out sequence's own blocks).
#[derive(Debug, Clone, Default)]
pub struct TieredHit {
    /// The L1 part (all of the hit when `slots` is empty).
    pub l1: PrefixHit,
    /// L2 slots loaded after the L1 blocks (pinned until admitted or released).
    pub slots: Vec<u32>,
    /// Hit tokens in all.
    pub num_tokens: usize,
    /// Full blocks of the hit and the key of the last one (the fetch continues from there).
    num_full: usize,
    last_key: BlockKey,
    swap: bool,
}

impl TieredHit {
    /// Hit tokens served from L1 (the rest of `num_tokens` is loaded from L2 slots).
    pub fn l1_tokens(&self) -> usize {
        self.l1.num_tokens
    }

    /// Hit tokens loaded from L2 (or from a swapped-out sequence's private slots).
    pub fn l2_tokens(&self) -> usize {
        self.num_tokens - self.l1.num_tokens
    }
}

impl KvManager {
    /// Turns on tiers (call once, before any request).
    pub fn enable_tiers(&mut self, cfg: TierConfig) {
        let n = self.pool.num_blocks();
        self.tiers = Some(Box::new(Tiers::new(cfg, n, self.block_size)));
    }

    /// The tier state, when tiers are on.
    pub fn tiers(&self) -> Option<&Tiers> {
        self.tiers.as_deref()
    }

    /// Tier counters (zeros when tiers are off).
    pub fn tier_stats(&self) -> TierStats {
        self.tiers.as_ref().map(|t| t.stats()).unwrap_or_default()
    }

    /// Updates the swap cost model's measurements.
    pub fn set_tier_costs(&mut self, copy_bytes_per_s: f64, seconds_per_token: f64) {
        if let Some(t) = self.tiers.as_mut() {
            if copy_bytes_per_s.is_finite() && copy_bytes_per_s > 0.0 {
                t.cfg.copy_bytes_per_s = copy_bytes_per_s;
            }
            if seconds_per_token.is_finite() && seconds_per_token > 0.0 {
                t.cfg.seconds_per_token = seconds_per_token;
            }
        }
    }

    /// L1 block `b` leaves the prefix cache; `write_back` on eviction. The L2 slot that holds
    /// its KV now, if any.
    pub(super) fn tier_uncached(&mut self, b: u32, write_back: bool) -> Option<u32> {
        self.tiers.as_mut()?.on_uncached(b, write_back)
    }

    /// The prefix cache forgets the L2 slots evicted since the last call (before any of them is
    /// named again); L1 blocks whose path lost every tier go to `dropped` (still cached in the
    /// pool: the caller uncaches them).
    pub(super) fn drop_evicted_slots(&mut self, dropped: &mut Vec<u32>) {
        let Some(t) = self.tiers.as_mut().filter(|t| t.host.has_evicted()) else {
            return;
        };
        for s in t.host.take_evicted() {
            self.cache.drop_l2(s, dropped);
        }
    }

    /// `drop_evicted_slots`, then uncaches the L1 blocks it dropped.
    fn sync_evicted_slots(&mut self) {
        let mut dropped = Vec::new();
        self.drop_evicted_slots(&mut dropped);
        if dropped.is_empty() {
            return;
        }
        self.epoch += 1;
        dropped.sort_unstable();
        for x in dropped {
            self.pool.set_cached(x, false);
            self.tier_uncached(x, false);
        }
    }

    /// Longest prefix of `tokens[..max_tokens]` in L1 then L2 (or `kv_id`'s swapped blocks),
    /// from one walk of the prefix cache. Hit slots are pinned: pass the hit to `admit_tiered`
    /// or `release_hit`.
    pub fn lookup_tiered(
        &mut self,
        kv_id: u64,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
    ) -> TieredHit {
        let bs = self.block_size as usize;
        let Some(t) = self.tiers.as_mut() else {
            let l1 = self.lookup_prefix(ns, tokens, max_tokens);
            let n = l1.num_tokens;
            return TieredHit {
                num_tokens: n,
                l1,
                ..TieredHit::default()
            };
        };
        let (mut blocks, mut slots) = (Vec::new(), Vec::new());
        let n = self
            .cache
            .match_tiered(ns, tokens, max_tokens, &mut blocks, &mut slots);
        let l1 = PrefixHit {
            num_tokens: n,
            blocks,
            ns,
            epoch: self.epoch,
        };
        let k1 = l1.num_tokens / bs;
        let root = t.root();
        let pk = match k1 {
            0 => root,
            _ => t
                .key_of(l1.blocks[k1 - 1])
                .unwrap_or_else(|| chain_from_root(root, ns, &tokens[..k1 * bs], bs)),
        };
        if let Some(sw) = t.swaps.get(&kv_id) {
            if sw.num_tokens > l1.num_tokens && sw.num_tokens <= max_tokens {
                let slots = sw.slots[k1..].to_vec();
                let num = sw.num_tokens;
                return TieredHit {
                    l1: truncated(l1, k1, bs),
                    slots,
                    num_tokens: num,
                    num_full: num / bs,
                    last_key: [0; 32],
                    swap: true,
                };
            }
        }
        // Every L2 entry the walk passed is a use (as a probe of L2 was), extending or not.
        slots.iter().for_each(|&s| t.host.touch(s));
        if (k1 + slots.len()) * bs <= l1.num_tokens {
            let n = l1.num_tokens;
            return TieredHit {
                num_tokens: n,
                l1,
                num_full: k1,
                last_key: pk,
                ..TieredHit::default()
            };
        }
        t.pin_hit(&slots);
        let last_key = match slots.last().map(|&s| t.host.state(s)) {
            Some(SlotState::Cached(k)) => k,
            _ => pk,
        };
        let num_full = k1 + slots.len();
        TieredHit {
            l1: truncated(l1, k1, bs),
            slots,
            num_tokens: num_full * bs,
            num_full,
            last_key,
            swap: false,
        }
    }

    /// Releases the pins of a hit that will not be admitted.
    pub fn release_hit(&mut self, hit: &TieredHit) {
        if let Some(t) = self.tiers.as_mut() {
            if !hit.swap {
                t.unpin_all(&hit.slots);
            }
        }
    }

    /// `admit` for a tiered hit: the hit's L2 blocks get fresh L1 blocks and load ops. Releases
    /// the hit's pins in every outcome. `Ok(false)`: not enough blocks, nothing changed.
    pub fn admit_tiered(
        &mut self,
        req: u64,
        ns: u64,
        tokens: &[u32],
        hit: &TieredHit,
        num_new_tokens: usize,
        watermark_blocks: u32,
    ) -> KvResult<bool> {
        if hit.slots.is_empty() {
            let ok = self.admit(req, ns, tokens, &hit.l1, num_new_tokens, watermark_blocks)?;
            if ok {
                if let Some(t) = self.tiers.as_mut() {
                    t.stats_mut().l1_hit_tokens += hit.num_tokens as u64;
                }
                // L1 still held a swapped-out sequence's blocks: its private slots go back.
                if let Some(sw) = self.tiers.as_mut().and_then(|t| t.swaps.remove(&req)) {
                    let t = self.tiers.as_mut().expect("checked above");
                    sw.slots.into_iter().for_each(|s| t.host.free_private(s));
                }
            }
            return Ok(ok);
        }
        let loaded = hit.num_tokens - hit.l1.num_tokens;
        let ok = self.admit(
            req,
            ns,
            tokens,
            &hit.l1,
            loaded + num_new_tokens,
            watermark_blocks,
        );
        let t = self.tiers.as_mut().expect("slots come from tiers");
        if !hit.swap {
            t.unpin_all(&hit.slots); // loads re-pin below, until the drain
        }
        if !matches!(ok, Ok(true)) {
            return ok;
        }
        let k1 = hit.l1.blocks.len();
        let table = &self.tables[&req];
        let blocks = &table.blocks[k1..k1 + hit.slots.len()];
        t.record_loads(&hit.slots, blocks);
        let st = t.stats_mut();
        st.l1_hit_tokens += hit.l1.num_tokens as u64;
        st.l2_hit_tokens += loaded as u64;
        if hit.swap {
            let sw = t.swaps.remove(&req).expect("a swap hit has a swap record");
            for &s in &sw.slots[..k1] {
                t.host.free_private(s); // those blocks were still cached in L1
            }
            t.stats_mut().swap_ins += 1;
        }
        Ok(true)
    }

    /// Whether `kv_id` should wait for L3/L4: when they exist, it was not asked yet and its
    /// prompt has full blocks beyond `hit`, records a fetch of them and returns true.
    pub fn want_fetch(&mut self, kv_id: u64, ns: u64, tokens: &[u32], hit: &TieredHit) -> bool {
        let bs = self.block_size as usize;
        let Some(t) = self.tiers.as_mut() else {
            return false;
        };
        if t.is_fetching(kv_id) {
            return true;
        }
        if !t.cfg.fetch || hit.swap || t.probed(kv_id) {
            return false;
        }
        let total = tokens.len().saturating_sub(1) / bs;
        if hit.num_full >= total {
            return false;
        }
        let mut keys = Vec::with_capacity(total - hit.num_full);
        let mut key = hit.last_key;
        for c in tokens[hit.num_full * bs..total * bs].chunks_exact(bs) {
            key = chain_key(&key, ns, c);
            keys.push(key);
        }
        let fetched = tokens[hit.num_full * bs..total * bs].to_vec();
        let prefix = tokens[..hit.num_full * bs].to_vec();
        t.start_fetch(kv_id, keys, fetched, ns, prefix);
        true
    }

    /// Swaps out `req`'s blocks covering its first `num_tokens` computed tokens to private L2
    /// slots, if the cost model prefers it and L2 has room; call before `free`. A block still
    /// waiting for a copy-on-write copy cannot be swapped (the copy runs after offloads).
    pub fn swap_out(&mut self, req: u64, num_tokens: usize) -> bool {
        let bs = self.block_size as usize;
        let (Some(t), Some(table)) = (self.tiers.as_mut(), self.tables.get(&req)) else {
            return false;
        };
        let nb = blocks_for(num_tokens, bs);
        if nb == 0 || t.cfg.host_blocks == 0 || !t.cfg.prefer_swap(nb, num_tokens) {
            return false;
        }
        let blocks = &table.blocks[..nb];
        // A table with released blocks (retention) is recomputed, never swapped.
        if table.num_released > 0 || self.copy_ops.iter().any(|op| blocks.contains(&op[1])) {
            return false;
        }
        let ok = t.swap_out(req, blocks, num_tokens);
        self.sync_evicted_slots();
        ok
    }

    /// Sequence `kv_id` finished or was aborted: drop its tier state.
    pub fn tier_forget(&mut self, kv_id: u64) {
        if let Some(t) = self.tiers.as_mut() {
            t.forget(kv_id);
        }
    }

    /// Whether `kv_id` waits for a fetch.
    pub fn is_fetching(&self, kv_id: u64) -> bool {
        self.tiers.as_ref().is_some_and(|t| t.is_fetching(kv_id))
    }

    /// `count` blocks of `kv_id`'s fetch arrived: the L2 slots to write them to. The prefix
    /// cache names each slot on its block's entry (radix: where the path to it is still there).
    pub fn tier_fetched(&mut self, kv_id: u64, count: usize) -> Vec<u32> {
        let Some(t) = self.tiers.as_mut() else {
            return Vec::new();
        };
        let done = t.fetched(kv_id, count);
        self.sync_evicted_slots();
        let t = self.tiers.as_ref().expect("checked above");
        for (s, key, path) in &done.attach {
            // A slot taken again later in the same batch holds another key: skip it.
            if t.host.state(*s) == SlotState::Cached(*key) {
                self.cache.attach_l2(done.ns, path, *s);
            }
        }
        done.slots
    }

    /// Moves the pending tier ops to `out` (release their pins). Apply before the forward.
    pub fn drain_tier_ops(&mut self, out: &mut TierOps) {
        match self.tiers.as_mut() {
            Some(t) => t.drain(out),
            None => *out = TierOps::default(),
        }
    }
}

/// `hit` cut to its first `k` full blocks.
fn truncated(mut hit: PrefixHit, k: usize, bs: usize) -> PrefixHit {
    hit.blocks.truncate(k);
    hit.num_tokens = k * bs;
    hit
}
