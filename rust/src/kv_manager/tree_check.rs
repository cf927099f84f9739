//! Checks of the prefix cache's tier entries against the tiers and a brute-force recount, for
//! tests (the proptest runs them after every step; they cost O(tree tokens × depth)).
//!
//! `check_tier_refs`: every L2 slot an entry names is a cached L2 slot whose key is the chained
//! key of the entry's path (radix) or whose tokens are the entry's (hash): no entry names a
//! free, private or reused slot; every L1 block an entry names is cached in the pool.
//! `lookup_counts` / `brute_counts`: the walk's L1 full blocks and L2 slots, and the same
//! counted from the entries one by one, without the walk.

use super::KvManager;
use crate::error::{KvError, KvResult};
use crate::prefix::radix::{NO_BLOCK, NO_SLOT};
use crate::prefix::PrefixCache;
use crate::tiers::{chain_from_root, SlotState};

impl KvManager {
    /// Entries of the prefix cache that name an L2 slot.
    pub fn num_l2_entries(&self) -> usize {
        self.cache.num_l2()
    }

    /// One walk, no pins and no counters: (L1 tokens, L1 blocks, L2 slots after them).
    pub fn lookup_counts(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max: usize,
    ) -> (usize, Vec<u32>, Vec<u32>) {
        let (mut l1, mut l2) = (Vec::new(), Vec::new());
        let n = self.cache.match_tiered(ns, tokens, max, &mut l1, &mut l2);
        (n, l1, l2)
    }

    /// Brute force: (L1 full blocks, L2 slots) of `tokens[..max]`, entry by entry.
    pub fn brute_counts(&mut self, ns: u64, tokens: &[u32], max: usize) -> (usize, Vec<u32>) {
        let bs = self.block_size as usize;
        let full = tokens.len().min(max) / bs * bs;
        let entries = self.cache.brute_entries(ns, &tokens[..full], bs);
        let k1 = entries.iter().take_while(|e| e.0 != NO_BLOCK).count();
        let slots = entries[k1..]
            .iter()
            .take_while(|e| e.1 != NO_SLOT)
            .map(|e| e.1)
            .collect();
        (k1, slots)
    }

    /// Radix mode: every entry as (namespace, path tokens, L1 block, L2 slot); else empty.
    pub fn tier_entries(&self) -> Vec<(u64, Vec<u32>, u32, u32)> {
        match &self.cache {
            PrefixCache::Radix(c) => c.entries(),
            _ => Vec::new(),
        }
    }

    /// Every tier reference of the prefix cache is valid (see the module header).
    pub fn check_tier_refs(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("tier refs: {m}")));
        let Some(t) = self.tiers.as_deref() else {
            return Ok(());
        };
        let bs = self.block_size as usize;
        let cached = |s: u32| match t.host.state(s) {
            SlotState::Cached(k) => Some(k),
            _ => None,
        };
        match &self.cache {
            PrefixCache::Radix(c) => {
                for (ns, path, b, s) in c.entries() {
                    if b != NO_BLOCK && !self.pool.is_cached(b) {
                        return bad(format!("entry names block {b}, not cached"));
                    }
                    if s == NO_SLOT {
                        continue;
                    }
                    let want = chain_from_root(t.root(), ns, &path, bs);
                    if cached(s) != Some(want) {
                        return bad(format!("entry names slot {s}: {:?}", t.host.state(s)));
                    }
                }
            }
            PrefixCache::Hash(c) => {
                for (_, b, s) in c.entries() {
                    if b != NO_BLOCK && !self.pool.is_cached(b) {
                        return bad(format!("entry names block {b}, not cached"));
                    }
                    if s != NO_SLOT && cached(s).is_none() {
                        return bad(format!("entry names slot {s}: {:?}", t.host.state(s)));
                    }
                }
            }
            PrefixCache::Off => {}
        }
        Ok(())
    }
}
