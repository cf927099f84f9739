//! Radix prefix cache: a compressed radix tree over token ids, one tree per namespace, whose
//! nodes outlive the KV pool: an entry whose block left L1 stays, naming the L2 slot that holds it.
//!
//! Each node owns an edge: `key` (tokens) and one entry per block of it, `blocks[i]` (the L1
//! block, or `NO_BLOCK`) and `l2[i]` (the L2 host slot, or `NO_SLOT`), with
//! `key.len() == blocks.len() * block_size`. Children of a node differ in their first block
//! (they may share a first token); a root has an empty edge.
//!
//! ```text
//!   root(ns) ── [b1 b2 s5] ─┬─ [b4]        s5: block 3 of the path is only in L2 slot 5
//!                           └─ [b7 s8]     b4 and b7 differ somewhere in their tokens
//! ```
//!
//! Tiers (see `tiers.rs`): evicting an L1 block whose KV was written back to an L2 slot
//! turns its entry into an L2 entry (`evict(b, Some(slot))`); an L2 eviction (`drop_l2`) clears
//! the slot; an entry with neither is removed at once, with everything below it (whose KV can
//! no longer be reached), so the tree never outgrows L1 + L2. A block loaded back from L2
//! re-attaches to its entry when it is cached again (`insert_block` on an L2-only entry).
//! No dangling references: `block_node`/`block_pos` and `slot_node`/`slot_pos` are back-pointers
//! from every L1 block and L2 slot to its entry, and every change of an entry updates them, so an
//! entry never names a freed block or a reused slot (`check_invariants` verifies both ways).
//!
//! Invariants: every cached block and every referenced slot appears in exactly one entry;
//! every entry holds an L1 block or an L2 slot; non-root nodes hold at least one entry; no hit
//! crosses namespaces (separate roots).
//!
//! Matching (`match_prefix`, L1 only) is at token granularity: the hit may end inside a block,
//! and the caller then copies that block before writing into it (copy-on-write). Locking is the
//! block pool's ref count: a request holds the blocks of its matched path. Eviction is driven by
//! the pool's LRU of unreferenced cached blocks, which releases a path leaf-first. The exception:
//! a copy op still reading a partly matched block can outlive the request that held its
//! ancestors; if an ancestor is evicted without an L2 copy, `evict` drops the whole subtree
//! below it and reports those blocks so the caller can uncache them.
//!
//! Costs: `match_prefix`/`match_tiered` O(matched tokens + children scanned); `insert_block`
//! O(block_size) (a split is O(edge length)); `evict` O(1) amortized. Lock idea after SGLang's
//! radix cache; keeping evicted nodes with a host copy after SGLang's HiCache.

use std::collections::HashMap;

use crate::block_pool::NULL_BLOCK;

const NO_NODE: u32 = u32::MAX;
/// An entry whose KV is not in L1.
pub const NO_BLOCK: u32 = u32::MAX;
/// An entry whose KV is not in L2.
pub const NO_SLOT: u32 = u32::MAX;

/// Result of offering one block to a prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    /// The block is now cached under the parent (a new entry, or re-attached to an L2 entry).
    Inserted,
    /// Another block already caches the same tokens under the parent; nothing changed.
    Existing(u32),
    /// The parent block is not cached (it was evicted); nothing changed.
    ParentNotCached,
}

#[derive(Debug, Clone, Default)]
struct Node {
    parent: u32,
    ns: u64,
    key: Vec<u32>,
    blocks: Vec<u32>,
    l2: Vec<u32>,
    /// Entries without an L1 block.
    off_l1: u32,
    children: Vec<u32>,
    /// First token of each child's key, beside `children`: scanned without touching children.
    child_first: Vec<u32>,
}

/// A radix tree of cached blocks keyed by token ids, per namespace.
#[derive(Debug, Clone)]
pub struct RadixCache {
    block_size: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    roots: HashMap<u64, u32>,
    block_node: Vec<u32>,
    block_pos: Vec<u32>,
    slot_node: Vec<u32>,
    slot_pos: Vec<u32>,
    num_cached: usize,
    num_l2: usize,
    inner_evictions: u64,
}

/// Length of the common prefix of `a` and `b`, comparing whole chunks first.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const CHUNK: usize = 16;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl RadixCache {
    /// An empty cache for a pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        RadixCache {
            block_size: block_size as usize,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::new(),
            block_node: vec![NO_NODE; num_blocks as usize],
            block_pos: vec![0; num_blocks as usize],
            slot_node: Vec::new(),
            slot_pos: Vec::new(),
            num_cached: 0,
            num_l2: 0,
            inner_evictions: 0,
        }
    }

    /// Number of cached (L1) blocks.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Whether block `b` is cached here.
    pub fn contains(&self, b: u32) -> bool {
        self.block_node[b as usize] != NO_NODE
    }

    /// Evictions that dropped cached blocks below the evicted one (the subtree was dropped).
    pub fn inner_evictions(&self) -> u64 {
        self.inner_evictions
    }

    /// Number of live tree nodes (roots included).
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    /// Longest prefix of `tokens[..max_tokens]` in `ns` whose KV is in L1, at token
    /// granularity. Appends the blocks that hold it to `out` (the last one possibly only partly
    /// matched) and returns the number of matched tokens.
    pub fn match_prefix(
        &self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        self.walk(ns, tokens, max_tokens, out, None)
    }

    /// Offers block `b` (uncached, holding `tokens`, one block's worth) as the child of
    /// `parent` (`NULL_BLOCK` = the root of `ns`). See [`InsertOutcome`]; an entry that only L2
    /// holds takes `b` as its L1 block (`Inserted`). `following` is how many blocks the caller
    /// will offer next, each the child of the previous one: a new leaf reserves room for them.
    pub fn insert_block(
        &mut self,
        ns: u64,
        parent: u32,
        tokens: &[u32],
        b: u32,
        following: usize,
    ) -> InsertOutcome {
        debug_assert_eq!(tokens.len(), self.block_size);
        debug_assert!(!self.contains(b));
        let (node, next_pos) = if parent == NULL_BLOCK {
            (self.root(ns), 0usize)
        } else {
            let n = self.block_node[parent as usize];
            if n == NO_NODE {
                return InsertOutcome::ParentNotCached;
            }
            (n, self.block_pos[parent as usize] as usize + 1)
        };
        let (n, pos, created) = self.place(ns, node, next_pos, tokens, following, b, NO_SLOT);
        if created {
            return InsertOutcome::Inserted;
        }
        let nd = &mut self.nodes[n as usize];
        if nd.blocks[pos] != NO_BLOCK {
            return InsertOutcome::Existing(nd.blocks[pos]);
        }
        nd.blocks[pos] = b; // re-attach: the block was loaded back from L2
        nd.off_l1 -= 1;
        self.set_block(b, n, pos);
        InsertOutcome::Inserted
    }

    /// Drops cached block `b` from L1 (just evicted by the pool). With `slot` (its KV was written
    /// back to that L2 slot) or an L2 slot already on its entry, the entry stays as an L2 entry.
    /// Otherwise the entry goes, and blocks cached below it, if any, are dropped too and
    /// appended to `also_dropped`.
    pub fn evict(&mut self, b: u32, slot: Option<u32>, also_dropped: &mut Vec<u32>) {
        let node = self.block_node[b as usize];
        if node == NO_NODE {
            return;
        }
        let pos = self.block_pos[b as usize] as usize;
        self.block_node[b as usize] = NO_NODE;
        self.num_cached -= 1;
        let nd = &mut self.nodes[node as usize];
        nd.blocks[pos] = NO_BLOCK;
        nd.off_l1 += 1;
        if let Some(s) = slot {
            self.set_slot(s, node, pos);
            return;
        }
        if nd.l2[pos] != NO_SLOT {
            return;
        }
        self.drop_entry(node, pos, also_dropped);
    }

    /// Entry `pos` of `node` holds KV on no tier any more: a leaf's last entry is trimmed in
    /// place (the usual case, no allocation), any other is cut off with everything below it.
    pub(super) fn drop_entry(&mut self, node: u32, pos: usize, dropped: &mut Vec<u32>) {
        let bs = self.block_size;
        let nd = &mut self.nodes[node as usize];
        if nd.children.is_empty() && pos + 1 == nd.blocks.len() {
            nd.blocks.pop();
            nd.l2.pop();
            nd.off_l1 -= 1;
            nd.key.truncate(pos * bs);
            if pos == 0 {
                self.remove_empty(node);
            }
            return;
        }
        self.cut(node, pos, dropped);
    }

    /// Removes entries `pos..` of `node` and every node below it (their blocks go to
    /// `dropped`, their slots lose their back-pointers); removes `node` too when `pos == 0`.
    fn cut(&mut self, node: u32, pos: usize, dropped: &mut Vec<u32>) {
        let bs = self.block_size;
        let nd = &mut self.nodes[node as usize];
        nd.child_first.clear();
        let children = std::mem::take(&mut nd.children);
        let had_l1_below = nd.blocks[pos..].iter().any(|&x| x != NO_BLOCK);
        let tail: Vec<u32> = nd.blocks.split_off(pos);
        let tail_l2: Vec<u32> = nd.l2.split_off(pos);
        nd.key.truncate(pos * bs);
        nd.off_l1 = nd.blocks.iter().filter(|&&x| x == NO_BLOCK).count() as u32;
        let before = dropped.len();
        for c in children {
            self.drop_subtree(c, dropped);
        }
        if had_l1_below || dropped.len() > before {
            self.inner_evictions += 1;
        }
        self.unindex(&tail, &tail_l2, dropped);
        if pos == 0 {
            self.remove_empty(node);
        }
    }

    /// Clears the back-pointers of `blocks`/`slots` (no longer in the tree); blocks go to `dropped`.
    fn unindex(&mut self, blocks: &[u32], slots: &[u32], dropped: &mut Vec<u32>) {
        for &x in blocks.iter().filter(|&&x| x != NO_BLOCK) {
            self.block_node[x as usize] = NO_NODE;
            self.num_cached -= 1;
            dropped.push(x);
        }
        for &s in slots.iter().filter(|&&s| s != NO_SLOT) {
            self.slot_node[s as usize] = NO_NODE;
            self.num_l2 -= 1;
        }
    }

    /// The root of `ns`, created if missing.
    fn root(&mut self, ns: u64) -> u32 {
        if let Some(&r) = self.roots.get(&ns) {
            return r;
        }
        let r = self.new_node(NO_NODE, ns, Vec::new(), Vec::new(), Vec::new());
        self.roots.insert(ns, r);
        r
    }

    /// The entry for `tokens` right after entry `next_pos - 1` of `node` (`next_pos == 0`: a
    /// root): `(node, pos, false)` when it exists, else a new entry `(l1, l2)` `(.., true)`.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        ns: u64,
        node: u32,
        next_pos: usize,
        tokens: &[u32],
        following: usize,
        l1: u32,
        l2: u32,
    ) -> (u32, usize, bool) {
        let bs = self.block_size;
        let nd = &self.nodes[node as usize];
        if next_pos < nd.blocks.len() {
            // The parent sits inside an edge: the next entry of the edge may be ours.
            if &nd.key[next_pos * bs..(next_pos + 1) * bs] == tokens {
                return (node, next_pos, false);
            }
            let upper = self.split(node, next_pos);
            let leaf = self.new_leaf(upper, ns, tokens, l1, l2, following);
            self.add_child(upper, leaf, tokens[0]);
            return (leaf, 0, true);
        }
        for (&c, _) in nd
            .children
            .iter()
            .zip(&nd.child_first)
            .filter(|(_, &f)| f == tokens[0])
        {
            if &self.nodes[c as usize].key[..bs] == tokens {
                return (c, 0, false);
            }
        }
        if nd.children.is_empty() && nd.parent != NO_NODE {
            // Extend a leaf edge in place: sequential inserts keep paths compressed.
            let nd = &mut self.nodes[node as usize];
            nd.key.extend_from_slice(tokens);
            nd.blocks.push(l1);
            nd.l2.push(l2);
            nd.off_l1 += (l1 == NO_BLOCK) as u32;
            let pos = nd.blocks.len() - 1;
            self.index_entry(node, pos);
            return (node, pos, true);
        }
        let leaf = self.new_leaf(node, ns, tokens, l1, l2, following);
        self.add_child(node, leaf, tokens[0]);
        (leaf, 0, true)
    }
}

mod nodes;
mod tiers;

#[cfg(test)]
mod tests;
