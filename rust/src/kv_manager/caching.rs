//! The [`KvManager`]'s prefix-cache side: lookups, publishing computed blocks, eviction.
//!
//! A lookup (`match_prefix`, `lookup_prefix`) walks the prefix cache and stamps the hit with the
//! manager's eviction epoch, so `admit` can refuse a hit that an eviction made stale. Publishing
//! (`cache_computed`) offers each not yet offered full block, parent first: a block whose
//! tokens are already cached under another block is swapped for that twin when the request is
//! its only holder (deduplication); the chain stops at a released block, a pending copy
//! destination, a parent the cache does not hold, or a twin the request cannot switch to.
//! `allocate_block` is the one place blocks are evicted: the pool hands out its LRU cached
//! block, the prefix cache forgets it (its entry keeps the L2 slot it is written back to when
//! tiers are on), and blocks that stop being cached with it are uncached in the pool.
//!
//! Costs: a lookup is the prefix cache's walk; publishing is O(block_size) per offered block
//! plus the cache's insert; an eviction is O(1) amortized (plus O(log L2 slots) write-back).

use super::{KvManager, PrefixHit};
use crate::block_pool::NULL_BLOCK;
use crate::error::KvResult;
use crate::prefix::radix::InsertOutcome;
use crate::prefix::PrefixMode;

impl KvManager {
    /// Longest cached prefix of `tokens` in `ns`, capped at `max_tokens` (callers pass
    /// `len - 1` so the last prompt token is always computed). Counts a query; no other effect.
    pub fn match_prefix(&mut self, ns: u64, tokens: &[u32], max_tokens: usize) -> PrefixHit {
        let hit = self.lookup_prefix(ns, tokens, max_tokens);
        self.record_query(tokens.len(), hit.num_tokens);
        hit
    }

    /// `match_prefix` without counting a query: for callers that may retry the same request
    /// (a scheduler's blocked queue head) and count it once, with `record_query`, when admitted.
    pub fn lookup_prefix(&mut self, ns: u64, tokens: &[u32], max_tokens: usize) -> PrefixHit {
        let mut blocks = Vec::new();
        let n = self.cache.match_prefix(ns, tokens, max_tokens, &mut blocks);
        PrefixHit {
            num_tokens: n,
            blocks,
            ns,
            epoch: self.epoch,
        }
    }

    /// Counts one prefix query of `query_tokens` tokens that hit `hit_tokens` of them.
    pub fn record_query(&mut self, query_tokens: usize, hit_tokens: usize) {
        self.stats.queries += 1;
        self.stats.query_tokens += query_tokens as u64;
        self.stats.hit_tokens += hit_tokens as u64;
    }

    /// `tokens` are `req`'s first tokens, all computed: its full blocks among them become
    /// cached. Err if `req` is unknown, `tokens` is longer than its table covers, or they
    /// disagree with the tokens `req` is known to hold (see [`KvManager::check_tokens`]).
    pub fn cache_computed(&mut self, req: u64, tokens: &[u32]) -> KvResult<()> {
        self.check_tokens(req, tokens)?;
        self.cache_checked(req, tokens);
        Ok(())
    }

    /// `cache_computed` for tokens that passed `check_tokens` (batch callers check first).
    pub(crate) fn cache_checked(&mut self, req: u64, tokens: &[u32]) {
        self.insert_computed(req, tokens);
        if self.cache.mode() == PrefixMode::Off {
            return;
        }
        let full = tokens.len() / self.block_size as usize * self.block_size as usize;
        let t = self.tables.get_mut(&req).expect("checked above");
        if full > t.tokens.len() {
            t.tokens.extend_from_slice(&tokens[t.tokens.len()..full]);
        }
    }

    /// Takes a block from the pool; the caller checked `num_free`. Evicts from the cache.
    pub(super) fn allocate_block(&mut self) -> u32 {
        let (b, evicted) = self.pool.allocate().expect("caller checked num_free");
        if evicted {
            self.epoch += 1;
            self.stats.evictions += 1;
            self.scratch.clear();
            let mut dropped = std::mem::take(&mut self.scratch);
            // Write-back to L2 (an op applied before the forward); the entry keeps the slot.
            let slot = self.tier_uncached(b, true);
            self.drop_evicted_slots(&mut dropped);
            self.cache.evict(b, slot, &mut dropped);
            dropped.retain(|&x| x != b);
            // Rare (see prefix::radix): a canonical order keeps the free queue deterministic.
            dropped.sort_unstable();
            for &x in &dropped {
                self.pool.set_cached(x, false);
                self.tier_uncached(x, false);
            }
            self.scratch = dropped;
        }
        b
    }

    /// Offers `req`'s not yet offered full blocks within `tokens` to the cache (validated).
    fn insert_computed(&mut self, req: u64, tokens: &[u32]) {
        if self.cache.mode() == PrefixMode::Off {
            return;
        }
        let bs = self.block_size as usize;
        let t = self.tables.get_mut(&req).expect("validated by the caller");
        if t.publish_closed {
            return; // thinned by a lossy policy: its KV is not what the tokens would give
        }
        let n_full = tokens.len() / bs;
        while t.num_cached_blocks < n_full {
            let i = t.num_cached_blocks;
            let b = t.blocks[i];
            if b == NULL_BLOCK || (i > 0 && t.blocks[i - 1] == NULL_BLOCK) {
                break; // released before it (or its parent) was published: the chain ends
            }
            if !self.copy_ops.is_empty() && self.copy_ops.iter().any(|op| op[1] == b) {
                break; // a pending copy's destination: its KV is not there yet
            }
            if !self.pool.is_cached(b) {
                let parent = if i == 0 { NULL_BLOCK } else { t.blocks[i - 1] };
                match self.cache.insert_block(
                    t.ns,
                    parent,
                    &tokens[i * bs..(i + 1) * bs],
                    b,
                    n_full - i - 1,
                ) {
                    InsertOutcome::Inserted => {
                        self.pool.set_cached(b, true);
                        if let Some(tiers) = self.tiers.as_mut() {
                            let parent = (i > 0).then(|| t.blocks[i - 1]);
                            tiers.cache_block(b, parent, t.ns, &tokens[..(i + 1) * bs]);
                        }
                    }
                    InsertOutcome::Existing(c) if self.pool.ref_count(b) == 1 => {
                        // Switch to the cached twin; our copy goes back to the free queue.
                        self.pool.incref(c);
                        self.pool.decref(b);
                        t.blocks[i] = c;
                        self.stats.deduplicated_blocks += 1;
                    }
                    InsertOutcome::Existing(_) | InsertOutcome::ParentNotCached => break,
                }
            }
            t.num_cached_blocks += 1;
        }
    }
}
