//! The block pool: ref counts of fixed-size KV blocks and the free queue.
//!
//! Block 0 is `NULL_BLOCK`: never handed out, never in the free queue; it pads block tables.
//! Every other block is either *referenced* (`ref_count > 0`, held by block tables and pending
//! copy ops) or *in the free queue* (`ref_count == 0`). A block may also be *cached*: the
//! prefix cache names it, so a prefix hit can revive it while it sits in the free queue.
//!
//! The free queue has two parts, taken in this order:
//!
//! ```text
//!   [uncached free blocks: a stack, top first] ++ [cached unreferenced blocks: LRU list]
//!    next allocated ...                            least recently released ... most recently
//! ```
//!
//! Eviction order (what `allocate` takes, first to last):
//! 1. free blocks that hold nothing cached, most recently freed first (LIFO keeps them warm);
//! 2. then cached blocks nobody references, least recently released first (LRU). A request
//!    releases its blocks last-to-first, so within one release the deepest block of a prefix
//!    goes first and a prefix is evicted from its leaves towards its root.
//!
//! The uncached part is a plain `Vec` stack (contiguous, the hot path of churn without a
//! prefix cache). The LRU part is a doubly linked list threaded through per-block `prev`/`next`
//! indices (no `unsafe`, no allocation after `new`) with slot 0 as its sentinel, so a prefix hit
//! revives a cached block from the middle in O(1); taking its head evicts it (`allocate`
//! returns `evicted = true` and the caller drops it from the prefix cache).
//!
//! Costs: `allocate`, `incref`, `decref` are O(1); `set_cached` is O(1) except for marking a
//! *free* block cached (O(free blocks); callers only cache referenced blocks).
//! `check_invariants` is O(n). Idea from vLLM's `FreeKVCacheBlockQueue` (a free list that
//! doubles as the LRU), split in two so the uncached blocks never pay for the links.

use crate::error::{KvError, KvResult};

/// Block id 0: reserved, pads block tables, never allocated.
pub const NULL_BLOCK: u32 = 0;

/// Per-block state, one 16-byte record so an operation touches one cache line per block.
#[derive(Debug, Clone, Copy, Default)]
struct BlockMeta {
    prev: u32,
    next: u32,
    ref_count: u32,
    cached: bool,
}

/// Ref counts plus the free queue of a fixed set of blocks.
#[derive(Debug, Clone)]
pub struct BlockPool {
    meta: Vec<BlockMeta>,
    /// Uncached free blocks; the last element is taken first.
    free_stack: Vec<u32>,
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
        // Ascending ids from the top: the first allocations get blocks 1, 2, 3, ...
        Ok(BlockPool {
            meta: vec![BlockMeta::default(); n],
            free_stack: (1..num_blocks).rev().collect(),
            num_free_cached: 0,
        })
    }

    /// Number of blocks, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.meta.len() as u32
    }

    /// Blocks `allocate` can hand out now: free ones plus evictable cached ones.
    pub fn num_free(&self) -> u32 {
        self.free_stack.len() as u32 + self.num_free_cached
    }

    /// Cached blocks nobody references (the evictable part of the free queue).
    pub fn num_free_cached(&self) -> u32 {
        self.num_free_cached
    }

    /// Ref count of block `b` (panics if out of range: callers validate ids first).
    pub fn ref_count(&self, b: u32) -> u32 {
        self.meta[b as usize].ref_count
    }

    /// Whether block `b` is named by the prefix cache.
    pub fn is_cached(&self, b: u32) -> bool {
        self.meta[b as usize].cached
    }

    /// True if `b` is a real block id of this pool (not null, not out of range).
    pub fn is_valid(&self, b: u32) -> bool {
        b != NULL_BLOCK && (b as usize) < self.meta.len()
    }

    /// Takes the first block of the free queue with ref count 1. `None` if the queue is empty.
    /// Returns `(block, evicted)`: `evicted` is true when the block was cached; it is now
    /// uncached and the caller must drop it from the prefix cache.
    pub fn allocate(&mut self) -> Option<(u32, bool)> {
        if let Some(b) = self.free_stack.pop() {
            self.meta[b as usize].ref_count = 1;
            return Some((b, false));
        }
        let b = self.meta[NULL_BLOCK as usize].next;
        if b == NULL_BLOCK {
            return None;
        }
        self.unlink(b);
        self.num_free_cached -= 1;
        let m = &mut self.meta[b as usize];
        m.cached = false;
        m.ref_count = 1;
        Some((b, true))
    }

    /// Adds a reference to `b`; a cached block in the free queue is revived.
    pub fn incref(&mut self, b: u32) {
        let i = b as usize;
        if self.meta[i].ref_count == 0 {
            if self.meta[i].cached {
                self.unlink(b);
                self.num_free_cached -= 1;
            } else {
                // Not a path the manager takes (it only revives cached blocks); kept correct.
                self.remove_from_stack(b);
            }
        }
        self.meta[i].ref_count += 1;
    }

    /// Drops a reference to `b`. At zero it joins the free queue: cached blocks at the tail
    /// of the LRU (most recently used), uncached ones on top of the stack.
    pub fn decref(&mut self, b: u32) {
        let m = &mut self.meta[b as usize];
        debug_assert!(m.ref_count > 0, "decref of free block {b}");
        m.ref_count -= 1;
        if m.ref_count == 0 {
            if m.cached {
                self.num_free_cached += 1;
                self.link_before(NULL_BLOCK, b);
            } else {
                self.free_stack.push(b);
            }
        }
    }

    /// Marks `b` cached or not. An unreferenced block moves to the matching part of the queue.
    pub fn set_cached(&mut self, b: u32, cached: bool) {
        let i = b as usize;
        if self.meta[i].cached == cached {
            return;
        }
        self.meta[i].cached = cached;
        if self.meta[i].ref_count == 0 {
            if cached {
                self.remove_from_stack(b);
                self.num_free_cached += 1;
                self.link_before(NULL_BLOCK, b);
            } else {
                self.unlink(b);
                self.num_free_cached -= 1;
                self.free_stack.push(b);
            }
        }
    }

    /// The free queue in allocation order (tests and debugging; O(n)).
    pub fn free_queue(&self) -> Vec<u32> {
        let mut out: Vec<u32> = self.free_stack.iter().rev().copied().collect();
        let mut b = self.meta[NULL_BLOCK as usize].next;
        while b != NULL_BLOCK && out.len() <= self.meta.len() {
            out.push(b);
            b = self.meta[b as usize].next;
        }
        out
    }

    /// Verifies the links, the counters, and that exactly the unreferenced blocks are queued:
    /// the uncached ones on the stack, the cached ones in the LRU list.
    pub fn check_invariants(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("block pool: {m}")));
        let null = &self.meta[NULL_BLOCK as usize];
        if null.ref_count != 0 || null.cached {
            return bad("the null block is referenced or cached".into());
        }
        let mut seen = vec![false; self.meta.len()];
        for &b in &self.free_stack {
            let m = self.meta.get(b as usize);
            if b == NULL_BLOCK || m.is_none() || seen[b as usize] {
                return bad(format!("block {b} stacked twice, null or out of range"));
            }
            seen[b as usize] = true;
            let m = m.expect("checked");
            if m.ref_count != 0 || m.cached {
                return bad(format!(
                    "stacked block {b}: ref count {}, cached {}",
                    m.ref_count, m.cached
                ));
            }
        }
        let (mut prev, mut b, mut num_cached) = (NULL_BLOCK, null.next, 0u32);
        while b != NULL_BLOCK {
            let i = b as usize;
            if i >= self.meta.len() || seen[i] {
                return bad(format!("block {b} listed twice or out of range"));
            }
            seen[i] = true;
            let m = &self.meta[i];
            if m.prev != prev {
                return bad(format!("broken prev link at block {b}"));
            }
            if m.ref_count != 0 || !m.cached {
                return bad(format!(
                    "LRU block {b}: ref count {}, cached {}",
                    m.ref_count, m.cached
                ));
            }
            num_cached += 1;
            prev = b;
            b = m.next;
        }
        if null.prev != prev {
            return bad("broken tail link".into());
        }
        if num_cached != self.num_free_cached {
            return bad(format!(
                "{num_cached} cached queued != {}",
                self.num_free_cached
            ));
        }
        for (b, (&queued, m)) in seen.iter().zip(&self.meta).enumerate().skip(1) {
            if !queued && m.ref_count == 0 {
                return bad(format!("block {b} has ref count 0 but is not queued"));
            }
        }
        Ok(())
    }

    fn remove_from_stack(&mut self, b: u32) {
        if let Some(pos) = self.free_stack.iter().rposition(|&x| x == b) {
            self.free_stack.remove(pos);
        }
    }

    /// Inserts `b` into the LRU list just before `at` (before the sentinel = at the tail).
    fn link_before(&mut self, at: u32, b: u32) {
        let p = self.meta[at as usize].prev;
        self.meta[b as usize].prev = p;
        self.meta[b as usize].next = at;
        self.meta[p as usize].next = b;
        self.meta[at as usize].prev = b;
    }

    /// Removes `b` from the LRU list in O(1).
    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.meta[b as usize].prev, self.meta[b as usize].next);
        self.meta[p as usize].next = n;
        self.meta[n as usize].prev = p;
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
