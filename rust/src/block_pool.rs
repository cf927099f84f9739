//! The block pool: ref counts of fixed-size KV blocks and the free queue.
//!
//! Block 0 is `NULL_BLOCK`: never handed out, never in the free queue; it pads block tables.
//! Every other block is either *referenced* (`ref_count > 0`, held by block tables and pending
//! copy ops) or *in the free queue* (`ref_count == 0`). A block may also be *cached*: the
//! prefix cache names it, so a prefix hit can revive it while it sits in the free queue.
//!
//! The free queue is one doubly linked list threaded through `prev`/`next` index arrays
//! (no `unsafe`, no allocation after `new`), with slot 0 (the null block) as its sentinel:
//!
//! ```text
//!   sentinel(0) <-> [uncached free blocks ...] <-> [cached, unreferenced blocks ...] <-> sentinel
//!    head: taken first                             least recently released ... most recently
//! ```
//!
//! Eviction order (what `allocate` takes, head first):
//! 1. free blocks that hold nothing cached, most recently freed first (LIFO keeps them warm);
//! 2. then cached blocks nobody references, least recently released first (LRU). A request
//!    releases its blocks last-to-first, so within one release the deepest block of a prefix
//!    goes first and a prefix is evicted from its leaves towards its root.
//!
//! Taking a cached block out of the queue either revives it (`incref` after a prefix hit, O(1)
//! removal from the middle) or evicts it (`allocate` returns `evicted = true` and the caller
//! drops it from the prefix cache).
//!
//! Costs: `allocate`, `incref`, `decref`, `set_cached` are O(1). `check_invariants` is O(n).
//! Idea from vLLM's `FreeKVCacheBlockQueue` (doubly linked free list doubling as the LRU).

use crate::error::{KvError, KvResult};

/// Block id 0: reserved, pads block tables, never allocated.
pub const NULL_BLOCK: u32 = 0;

/// Ref counts plus the free queue of a fixed set of blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_count: Vec<u32>,
    cached: Vec<bool>,
    prev: Vec<u32>,
    next: Vec<u32>,
    num_free: u32,
    num_free_cached: u32,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (block 0 included), all free and uncached.
    pub fn new(num_blocks: u32) -> KvResult<Self> {
        if num_blocks < 2 {
            return Err(KvError::InvalidArgument(format!(
                "num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}"
            )));
        }
        let n = num_blocks as usize;
        let mut pool = BlockPool {
            ref_count: vec![0; n],
            cached: vec![false; n],
            prev: vec![NULL_BLOCK; n],
            next: vec![NULL_BLOCK; n],
            num_free: 0,
            num_free_cached: 0,
        };
        // Ascending ids from the head: the first allocations get blocks 1, 2, 3, ...
        for b in 1..num_blocks {
            pool.link_before(NULL_BLOCK, b);
        }
        pool.num_free = num_blocks - 1;
        Ok(pool)
    }

    /// Number of blocks, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.ref_count.len() as u32
    }

    /// Blocks `allocate` can hand out now: free ones plus evictable cached ones.
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Cached blocks nobody references (the evictable part of the free queue).
    pub fn num_free_cached(&self) -> u32 {
        self.num_free_cached
    }

    /// Ref count of block `b` (panics if out of range: callers validate ids first).
    pub fn ref_count(&self, b: u32) -> u32 {
        self.ref_count[b as usize]
    }

    /// Whether block `b` is named by the prefix cache.
    pub fn is_cached(&self, b: u32) -> bool {
        self.cached[b as usize]
    }

    /// True if `b` is a real block id of this pool (not null, not out of range).
    pub fn is_valid(&self, b: u32) -> bool {
        b != NULL_BLOCK && (b as usize) < self.ref_count.len()
    }

    /// Takes the head of the free queue with ref count 1. `None` if the queue is empty.
    /// Returns `(block, evicted)`: `evicted` is true when the block was cached; it is now
    /// uncached and the caller must drop it from the prefix cache.
    pub fn allocate(&mut self) -> Option<(u32, bool)> {
        let b = self.next[NULL_BLOCK as usize];
        if b == NULL_BLOCK {
            return None;
        }
        self.unlink(b);
        self.num_free -= 1;
        let evicted = self.cached[b as usize];
        if evicted {
            self.cached[b as usize] = false;
            self.num_free_cached -= 1;
        }
        self.ref_count[b as usize] = 1;
        Some((b, evicted))
    }

    /// Adds a reference to `b`; a block in the free queue (a cached one) is revived.
    pub fn incref(&mut self, b: u32) {
        let i = b as usize;
        if self.ref_count[i] == 0 {
            debug_assert!(self.cached[i], "reviving an uncached free block {b}");
            self.unlink(b);
            self.num_free -= 1;
            if self.cached[i] {
                self.num_free_cached -= 1;
            }
        }
        self.ref_count[i] += 1;
    }

    /// Drops a reference to `b`. At zero it joins the free queue: cached blocks at the tail
    /// (most recently used end of the LRU), uncached ones at the head.
    pub fn decref(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.ref_count[i] > 0, "decref of free block {b}");
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            self.num_free += 1;
            if self.cached[i] {
                self.num_free_cached += 1;
                self.link_before(NULL_BLOCK, b);
            } else {
                let head = self.next[NULL_BLOCK as usize];
                self.link_before(head, b);
            }
        }
    }

    /// Marks `b` cached or not. An unreferenced block moves to the matching end of the queue.
    pub fn set_cached(&mut self, b: u32, cached: bool) {
        let i = b as usize;
        if self.cached[i] == cached {
            return;
        }
        self.cached[i] = cached;
        if self.ref_count[i] == 0 {
            self.unlink(b);
            if cached {
                self.num_free_cached += 1;
                self.link_before(NULL_BLOCK, b);
            } else {
                self.num_free_cached -= 1;
                let head = self.next[NULL_BLOCK as usize];
                self.link_before(head, b);
            }
        }
    }

    /// The free queue from head to tail (tests and debugging; O(n)).
    pub fn free_queue(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.num_free as usize);
        let mut b = self.next[NULL_BLOCK as usize];
        while b != NULL_BLOCK && out.len() <= self.ref_count.len() {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }

    /// Verifies the queue links, the counters, and that exactly the unreferenced blocks are
    /// queued with the uncached ones ahead of the cached ones.
    pub fn check_invariants(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("block pool: {m}")));
        if self.ref_count[NULL_BLOCK as usize] != 0 || self.cached[NULL_BLOCK as usize] {
            return bad("the null block is referenced or cached".into());
        }
        let queue = self.free_queue();
        if queue.len() != self.num_free as usize {
            return bad(format!(
                "queue length {} != num_free {}",
                queue.len(),
                self.num_free
            ));
        }
        let mut seen = vec![false; self.ref_count.len()];
        let mut prev = NULL_BLOCK;
        let mut in_cached_part = false;
        let mut num_cached = 0;
        for &b in &queue {
            let i = b as usize;
            if b == NULL_BLOCK || seen[i] {
                return bad(format!("block {b} queued twice or null"));
            }
            seen[i] = true;
            if self.prev[i] != prev {
                return bad(format!("broken prev link at block {b}"));
            }
            if self.ref_count[i] != 0 {
                return bad(format!(
                    "queued block {b} has ref count {}",
                    self.ref_count[i]
                ));
            }
            if self.cached[i] {
                in_cached_part = true;
                num_cached += 1;
            } else if in_cached_part {
                return bad(format!("uncached block {b} behind cached blocks"));
            }
            prev = b;
        }
        if self.prev[NULL_BLOCK as usize] != prev {
            return bad("broken tail link".into());
        }
        if num_cached != self.num_free_cached {
            return bad(format!(
                "{num_cached} cached queued != {}",
                self.num_free_cached
            ));
        }
        for (b, (&queued, &rc)) in seen.iter().zip(&self.ref_count).enumerate().skip(1) {
            if !queued && rc == 0 {
                return bad(format!("block {b} has ref count 0 but is not queued"));
            }
        }
        Ok(())
    }

    /// Inserts `b` just before `at` (before the sentinel = at the tail).
    fn link_before(&mut self, at: u32, b: u32) {
        let p = self.prev[at as usize];
        self.prev[b as usize] = p;
        self.next[b as usize] = at;
        self.next[p as usize] = b;
        self.prev[at as usize] = b;
    }

    /// Removes `b` from the queue in O(1).
    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_in_id_order_and_rejects_tiny_pools() {
        assert!(BlockPool::new(0).is_err());
        assert!(BlockPool::new(1).is_err());
        let mut p = BlockPool::new(4).unwrap();
        assert_eq!(p.free_queue(), vec![1, 2, 3]);
        assert_eq!(p.allocate(), Some((1, false)));
        assert_eq!(p.allocate(), Some((2, false)));
        assert_eq!(p.allocate(), Some((3, false)));
        assert_eq!(p.allocate(), None);
        assert_eq!(p.num_free(), 0);
        p.check_invariants().unwrap();
    }

    #[test]
    fn uncached_free_goes_to_head_cached_to_tail() {
        let mut p = BlockPool::new(6).unwrap();
        let ids: Vec<u32> = (0..5).map(|_| p.allocate().unwrap().0).collect();
        assert_eq!(ids, vec![1, 2, 3, 4, 5]);
        p.set_cached(2, true);
        p.set_cached(3, true);
        // Release 3, 2 (deepest first), then the uncached 1 and 5.
        p.decref(3);
        p.decref(2);
        p.decref(1);
        p.decref(5);
        assert_eq!(p.free_queue(), vec![5, 1, 3, 2]);
        assert_eq!(p.num_free_cached(), 2);
        p.check_invariants().unwrap();
        // A hit revives 3 from the middle of the LRU part.
        p.incref(3);
        assert_eq!(p.free_queue(), vec![5, 1, 2]);
        assert_eq!(p.ref_count(3), 1);
        // Uncached blocks go first, then the LRU cached block, reported as evicted.
        assert_eq!(p.allocate(), Some((5, false)));
        assert_eq!(p.allocate(), Some((1, false)));
        assert_eq!(p.allocate(), Some((2, true)));
        assert!(!p.is_cached(2));
        assert_eq!(p.allocate(), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn uncaching_a_queued_block_moves_it_to_the_head() {
        let mut p = BlockPool::new(4).unwrap();
        for _ in 0..3 {
            p.allocate().unwrap();
        }
        p.set_cached(1, true);
        p.set_cached(2, true);
        p.decref(1);
        p.decref(2);
        p.decref(3);
        assert_eq!(p.free_queue(), vec![3, 1, 2]);
        p.set_cached(2, false);
        assert_eq!(p.free_queue(), vec![2, 3, 1]);
        assert_eq!(p.num_free_cached(), 1);
        p.incref(1);
        p.incref(1);
        assert_eq!(p.ref_count(1), 2);
        p.decref(1);
        assert_eq!(p.free_queue(), vec![2, 3]);
        p.check_invariants().unwrap();
    }
}
