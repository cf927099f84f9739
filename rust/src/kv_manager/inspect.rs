//! Read-only side of the [`KvManager`]: sizes, per-request and per-block queries, counters and
//! `check_invariants` (pool, prefix cache, tables and pending copy ops against each other).
//!
//! A child module of `kv_manager`, so it reads the manager's private fields; nothing here
//! mutates. Costs: O(1) per query except `free_queue` (O(blocks)), `check_tokens` (O(tokens))
//! and `check_invariants` (O(blocks + table entries)).

use super::{CacheStats, KvManager};
use crate::error::{KvError, KvResult};
use crate::prefix::PrefixMode;

impl KvManager {
    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.pool.num_blocks()
    }

    /// The prefix-cache mode.
    pub fn prefix_mode(&self) -> PrefixMode {
        self.cache.mode()
    }

    /// Blocks allocatable now: free ones plus evictable (cached, unreferenced) ones.
    pub fn num_free_blocks(&self) -> u32 {
        self.pool.num_free()
    }

    /// Fraction of the non-null blocks that are referenced.
    pub fn usage(&self) -> f64 {
        let n = self.pool.num_blocks() - 1;
        (n - self.pool.num_free()) as f64 / n as f64
    }

    /// Number of live requests.
    pub fn num_requests(&self) -> usize {
        self.tables.len()
    }

    /// Whether `req` is live.
    pub fn contains(&self, req: u64) -> bool {
        self.tables.contains_key(&req)
    }

    /// Tokens covered by `req`'s table.
    pub fn num_tokens(&self, req: u64) -> KvResult<usize> {
        Ok(self.table(req)?.num_tokens)
    }

    /// Most tokens one request can ever hold: every non-null block.
    pub fn max_tokens(&self) -> usize {
        (self.pool.num_blocks() as usize - 1) * self.block_size as usize
    }

    /// Ref count of block `id` (Err for an id outside the pool).
    pub fn ref_count(&self, id: u32) -> KvResult<u32> {
        if id >= self.pool.num_blocks() {
            return Err(KvError::InvalidBlock(format!(
                "block {id} outside a pool of {}",
                self.pool.num_blocks()
            )));
        }
        Ok(self.pool.ref_count(id))
    }

    /// The chained hash of cached block `id` (hash mode; `None` otherwise or when uncached).
    pub fn block_hash(&self, id: u32) -> Option<u128> {
        if id >= self.pool.num_blocks() {
            return None;
        }
        self.cache.block_hash(id)
    }

    /// The free queue, head (next allocated) first: tests and debugging, O(n).
    pub fn free_queue(&self) -> Vec<u32> {
        self.pool.free_queue()
    }

    /// `req`'s block table.
    pub fn block_table(&self, req: u64) -> KvResult<&[u32]> {
        Ok(&self.table(req)?.blocks)
    }

    /// Number of pending copy ops.
    pub fn num_pending_copy_ops(&self) -> usize {
        self.copy_ops.len()
    }

    /// Counters since construction.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            cached_blocks: self.cache.num_cached() as u64,
            ..self.stats
        }
    }

    /// Checks that `tokens` may be stated as `req`'s first computed tokens: `req` is live, its
    /// table covers them, and they agree with the tokens it is known to hold (its prompt and
    /// the full blocks stated before). What `cache_computed` and `free` check; no effect.
    pub fn check_tokens(&self, req: u64, tokens: &[u32]) -> KvResult<()> {
        let t = self.table(req)?;
        if tokens.len() > t.num_tokens {
            return Err(KvError::InvalidArgument(format!(
                "request {req}: {} computed tokens but its table covers {}",
                tokens.len(),
                t.num_tokens
            )));
        }
        let k = tokens.len().min(t.tokens.len());
        if tokens[..k] != t.tokens[..k] {
            let p = (0..k)
                .find(|&p| tokens[p] != t.tokens[p])
                .expect("slices differ");
            return Err(KvError::InvalidArgument(format!(
                "request {req}: token {p} is {} but the request holds {} (its tokens cannot \
                 change once admitted or computed)",
                tokens[p], t.tokens[p]
            )));
        }
        Ok(())
    }

    /// Verifies pool, cache and tables against each other (O(blocks + table entries)).
    pub fn check_invariants(&self) -> KvResult<()> {
        self.pool.check_invariants()?;
        self.cache.check_invariants()?;
        let n = self.pool.num_blocks();
        let mut holders = vec![0u32; n as usize];
        for (&req, t) in &self.tables {
            t.check(self.block_size as usize, n)
                .map_err(|e| KvError::Invariant(format!("request {req}: {e}")))?;
            for &b in t.blocks.iter().filter(|&&b| b != 0) {
                holders[b as usize] += 1;
            }
        }
        for op in &self.copy_ops {
            if !self.pool.is_valid(op[0]) || !self.pool.is_valid(op[1]) {
                return Err(KvError::Invariant(format!(
                    "copy op {op:?} names an invalid block"
                )));
            }
            holders[op[0] as usize] += 1;
            // A pending destination is someone's block, and its KV is not there yet.
            if self.pool.ref_count(op[1]) == 0 || self.pool.is_cached(op[1]) {
                return Err(KvError::Invariant(format!(
                    "copy op {op:?} writes a free or cached block"
                )));
            }
        }
        for b in 0..n {
            if holders[b as usize] != self.pool.ref_count(b) {
                return Err(KvError::Invariant(format!(
                    "block {b}: ref count {} but {} holders",
                    self.pool.ref_count(b),
                    holders[b as usize]
                )));
            }
            if self.pool.is_cached(b) != self.cache.contains(b) {
                return Err(KvError::Invariant(format!(
                    "block {b}: pool and prefix cache disagree on caching"
                )));
            }
        }
        Ok(())
    }
}
