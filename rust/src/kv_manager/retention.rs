//! Retention on the [`KvManager`]: releasing a request's blocks that no later step reads.
//!
//! ```text
//!   logical block   0    1    2    3    4    5    6 (partial, being written)
//!   before          b7   b3   b9   b4   b8   b2   b5
//!   release(1..4)   b7   0    0    0    b8   b2   b5     (sink:1 block, window:2 blocks)
//! ```
//!
//! A released entry becomes the null block (0) and its reference goes back to the pool (a cached
//! block stays cached, evictable, like any freed one). Positions stay logical: the scheduler
//! keeps `positions`/`seq_lens` as they were and the kernels skip null entries (or never reach
//! them: a sliding-window layer starts at its window). Only full blocks below the first
//! position a later step can query are released, never the partial last block, never a block
//! a pending copy op still has to write.
//!
//! Prefix caching stays exact: `insert_computed` stops at a null entry or a null parent (the
//! chain is broken), and a *lossy* release closes publishing for good (`publish_closed`): KV
//! computed after a drop differs from what the tokens would give. Blocks published before the
//! first lossy drop were computed with the whole context, so they stay in the cache.
//! Cost: O(hi - lo) per call.

use super::KvManager;
use crate::block_pool::NULL_BLOCK;
use crate::error::{KvError, KvResult};

impl KvManager {
    /// Releases `req`'s blocks `lo..hi` (logical indices; capped at its full blocks), skipping
    /// entries already released. `lossy`: the release drops KV some layer could still see (a
    /// retention policy), so nothing more of `req` is ever published. Returns the number of
    /// blocks released. Err: unknown request (nothing changed).
    pub fn release_blocks(
        &mut self,
        req: u64,
        lo: usize,
        hi: usize,
        lossy: bool,
    ) -> KvResult<usize> {
        let bs = self.block_size as usize;
        let t = self
            .tables
            .get_mut(&req)
            .ok_or(KvError::UnknownRequest(req))?;
        let hi = hi.min(t.num_tokens / bs);
        let mut n = 0;
        for i in lo..hi {
            let b = t.blocks[i];
            if b == NULL_BLOCK || self.copy_ops.iter().any(|op| op[1] == b) {
                continue;
            }
            t.blocks[i] = NULL_BLOCK;
            self.pool.decref(b);
            n += 1;
        }
        t.num_released += n;
        if lossy && n > 0 {
            t.publish_closed = true;
        }
        Ok(n)
    }

    /// Blocks `req` holds now (non-null table entries).
    pub fn num_held_blocks(&self, req: u64) -> KvResult<usize> {
        Ok(self.table(req)?.num_held())
    }

    /// Whether a lossy release closed `req`'s publishing to the prefix cache.
    pub fn publish_closed(&self, req: u64) -> KvResult<bool> {
        Ok(self.table(req)?.publish_closed)
    }
}

#[cfg(test)]
mod tests {
    use crate::kv_manager::{KvManager, KvManagerConfig, PrefixHit};
    use crate::prefix::PrefixMode;

    fn mgr(mode: PrefixMode) -> KvManager {
        KvManager::new(KvManagerConfig {
            num_blocks: 16,
            block_size: 4,
            prefix_mode: mode,
        })
        .unwrap()
    }

    #[test]
    fn release_frees_full_blocks_only_and_free_returns_the_rest() {
        let mut m = mgr(PrefixMode::Off);
        let toks: Vec<u32> = (0..18).collect();
        assert!(m.admit(1, 0, &toks, &PrefixHit::default(), 18, 0).unwrap());
        assert_eq!(m.num_free_blocks(), 15 - 5);
        // 4 full blocks + a partial one: hi is capped at the full ones.
        assert_eq!(m.release_blocks(1, 1, 99, true).unwrap(), 3);
        assert_eq!(m.release_blocks(1, 0, 99, true).unwrap(), 1); // only block 0 left
        assert_eq!(m.num_held_blocks(1).unwrap(), 1);
        assert_eq!(m.block_table(1).unwrap()[..4], [0, 0, 0, 0]);
        m.check_invariants().unwrap();
        m.free(1, &[]).unwrap();
        assert_eq!(m.num_free_blocks(), 15);
        m.check_invariants().unwrap();
        assert!(m.release_blocks(1, 0, 1, false).is_err());
    }

    #[test]
    fn lossy_release_stops_publishing_exact_release_keeps_the_chain() {
        let mut m = mgr(PrefixMode::Radix);
        let toks: Vec<u32> = (0..17).collect();
        assert!(m.admit(1, 0, &toks, &PrefixHit::default(), 17, 0).unwrap());
        m.cache_computed(1, &toks[..8]).unwrap(); // blocks 0, 1 published
        assert_eq!(m.release_blocks(1, 1, 2, true).unwrap(), 1);
        assert!(m.publish_closed(1).unwrap());
        m.cache_computed(1, &toks[..16]).unwrap(); // nothing more
        assert_eq!(m.stats().cached_blocks, 2);
        m.free(1, &toks[..16]).unwrap();
        assert_eq!(m.stats().cached_blocks, 2);
        m.check_invariants().unwrap();
        // Exact release after publication: later blocks still chain onto held parents.
        let mut m = mgr(PrefixMode::Radix);
        assert!(m.admit(2, 0, &toks, &PrefixHit::default(), 17, 0).unwrap());
        m.cache_computed(2, &toks[..8]).unwrap();
        assert_eq!(m.release_blocks(2, 0, 1, false).unwrap(), 1);
        m.cache_computed(2, &toks[..16]).unwrap();
        assert_eq!(m.stats().cached_blocks, 4);
        // A fork shares only what is held.
        m.fork(2, 3).unwrap();
        m.check_invariants().unwrap();
        m.free(2, &toks[..16]).unwrap();
        m.free(3, &toks[..16]).unwrap();
        assert_eq!(m.num_free_blocks(), 15);
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_block_released_before_publication_ends_the_chain() {
        let mut m = mgr(PrefixMode::Radix);
        let toks: Vec<u32> = (0..17).collect();
        assert!(m.admit(1, 0, &toks, &PrefixHit::default(), 17, 0).unwrap());
        assert_eq!(m.release_blocks(1, 1, 2, false).unwrap(), 1);
        m.cache_computed(1, &toks[..16]).unwrap();
        assert_eq!(m.stats().cached_blocks, 1); // block 0 only: 1 is gone, 2 has no parent
        m.free(1, &toks[..16]).unwrap();
        m.check_invariants().unwrap();
    }
}
