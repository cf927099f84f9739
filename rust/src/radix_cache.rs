//! Radix prefix cache: a compressed radix tree over token ids, one tree per namespace.
//!
//! Each node owns an edge: `key` (tokens) and `blocks` (the cached KV blocks of those tokens),
//! with `key.len() == blocks.len() * block_size` (stored at block granularity). Children of a
//! node differ in their first block (they may share a first token); a root has an empty edge.
//!
//! ```text
//!   root(ns) ── [b1 b2 b3] ─┬─ [b4]        key of [b1 b2 b3] = 3 * block_size tokens
//!                           └─ [b7 b8]     b4 and b7 differ somewhere in their tokens
//! ```
//!
//! Invariants: every cached block appears in exactly one node (`block_node`/`block_pos` say
//! where); non-root nodes hold at least one block; no hit crosses namespaces (separate roots).
//!
//! Matching is at token granularity: the hit may end inside a block, and the caller then
//! copies that block before writing into it (copy-on-write). Locking is the block pool's ref
//! count: a request holds the blocks of its matched path. Eviction is driven by the pool's LRU
//! of unreferenced cached blocks, which releases a path leaf-first, so `evict` normally trims
//! the last block of a childless node. The exception: a copy op still reading a partly matched
//! block can outlive the request that held its ancestors; if an ancestor is evicted first,
//! `evict` drops the whole subtree below it and reports those blocks so the caller can
//! uncache them (unreferenced ones go back to the free queue as plain free blocks).
//!
//! Costs: `match_prefix` is O(matched tokens + children scanned); `insert_block` O(block_size)
//! (a split is O(edge length)); `evict` O(1) amortized. Lock idea after SGLang's radix cache.

use std::collections::HashMap;

use crate::block_pool::NULL_BLOCK;
use crate::error::{KvError, KvResult};

const NO_NODE: u32 = u32::MAX;

/// Result of offering one block to a prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    /// The block is now cached under the parent.
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
    num_cached: usize,
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
            num_cached: 0,
            inner_evictions: 0,
        }
    }

    /// Number of cached blocks.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Whether block `b` is cached here.
    pub fn contains(&self, b: u32) -> bool {
        self.block_node[b as usize] != NO_NODE
    }

    /// Evictions that hit a block with cached blocks below it (the subtree was dropped).
    pub fn inner_evictions(&self) -> u64 {
        self.inner_evictions
    }

    /// Number of live tree nodes (roots included).
    pub fn num_nodes(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    /// Longest cached prefix of `tokens[..max_tokens]` in `ns`, at token granularity. Appends
    /// the blocks that hold it to `out` (the last one possibly only partly matched) and
    /// returns the number of matched tokens.
    pub fn match_prefix(
        &self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        let limit = tokens.len().min(max_tokens);
        let Some(&root) = self.roots.get(&ns) else {
            return 0;
        };
        let bs = self.block_size;
        let (mut node, mut t) = (root, 0usize);
        while t < limit {
            let rest = &tokens[t..limit];
            let (mut best, mut best_len) = (NO_NODE, 0usize);
            let nd = &self.nodes[node as usize];
            for (&c, _) in nd
                .children
                .iter()
                .zip(&nd.child_first)
                .filter(|(_, &f)| f == rest[0])
            {
                let key = &self.nodes[c as usize].key;
                {
                    let l = common_prefix(key, rest);
                    // Ties (partial first blocks only) go to the lowest block id: deterministic.
                    let tie = l == best_len
                        && self.nodes[c as usize].blocks[0] < self.nodes[best as usize].blocks[0];
                    if l > best_len || tie {
                        (best, best_len) = (c, l);
                    }
                }
            }
            if best == NO_NODE {
                break;
            }
            let child = &self.nodes[best as usize];
            if best_len == child.key.len() {
                out.extend_from_slice(&child.blocks);
                t += best_len;
                node = best;
            } else {
                out.extend_from_slice(&child.blocks[..best_len.div_ceil(bs)]);
                t += best_len;
                break;
            }
        }
        t
    }

    /// Offers block `b` (uncached, holding `tokens`, one block's worth) as the child of
    /// `parent` (`NULL_BLOCK` = the root of `ns`). See [`InsertOutcome`]. `following` is how
    /// many blocks the caller will offer next, each the child of the previous one: a new leaf
    /// reserves room for them so extending it does not reallocate.
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
        let bs = self.block_size;
        let (node, next_pos) = if parent == NULL_BLOCK {
            let root = match self.roots.get(&ns) {
                Some(&r) => r,
                None => {
                    let r = self.new_node(NO_NODE, ns, Vec::new(), Vec::new());
                    self.roots.insert(ns, r);
                    r
                }
            };
            (root, 0usize)
        } else {
            let n = self.block_node[parent as usize];
            if n == NO_NODE {
                return InsertOutcome::ParentNotCached;
            }
            (n, self.block_pos[parent as usize] as usize + 1)
        };
        let nd = &self.nodes[node as usize];
        if next_pos < nd.blocks.len() {
            // The parent sits inside an edge: the next block of the edge may be ours.
            if &nd.key[next_pos * bs..(next_pos + 1) * bs] == tokens {
                return InsertOutcome::Existing(nd.blocks[next_pos]);
            }
            let upper = self.split(node, next_pos);
            let leaf = self.new_leaf(upper, ns, tokens, b, following);
            self.add_child(upper, leaf, tokens[0]);
            self.set_block(b, leaf, 0);
            return InsertOutcome::Inserted;
        }
        for (&c, _) in nd
            .children
            .iter()
            .zip(&nd.child_first)
            .filter(|(_, &f)| f == tokens[0])
        {
            if &self.nodes[c as usize].key[..bs] == tokens {
                return InsertOutcome::Existing(self.nodes[c as usize].blocks[0]);
            }
        }
        if nd.children.is_empty() && nd.parent != NO_NODE {
            // Extend a leaf edge in place: sequential inserts keep paths compressed.
            let nd = &mut self.nodes[node as usize];
            nd.key.extend_from_slice(tokens);
            nd.blocks.push(b);
            let pos = nd.blocks.len() - 1;
            self.set_block(b, node, pos);
        } else {
            let leaf = self.new_leaf(node, ns, tokens, b, following);
            self.add_child(node, leaf, tokens[0]);
            self.set_block(b, leaf, 0);
        }
        InsertOutcome::Inserted
    }

    /// Drops cached block `b` (just evicted by the pool). Blocks cached below it, if any, are
    /// dropped too and appended to `also_dropped`.
    pub fn evict(&mut self, b: u32, also_dropped: &mut Vec<u32>) {
        let node = self.block_node[b as usize];
        if node == NO_NODE {
            return;
        }
        let pos = self.block_pos[b as usize] as usize;
        let bs = self.block_size;
        let nd = &mut self.nodes[node as usize];
        if nd.children.is_empty() && pos + 1 == nd.blocks.len() {
            // The usual case: trim the last block of a leaf, no allocation.
            nd.blocks.pop();
            nd.key.truncate(pos * bs);
            self.block_node[b as usize] = NO_NODE;
            self.num_cached -= 1;
            if pos == 0 {
                self.remove_empty(node);
            }
            return;
        }
        // An inner block: drop everything cached below it too.
        nd.child_first.clear();
        let children = std::mem::take(&mut nd.children);
        if !children.is_empty() || pos + 1 < self.nodes[node as usize].blocks.len() {
            self.inner_evictions += 1;
        }
        for c in children {
            self.drop_subtree(c, also_dropped);
        }
        let nd = &mut self.nodes[node as usize];
        let tail: Vec<u32> = nd.blocks.split_off(pos);
        nd.key.truncate(pos * bs);
        for &x in &tail {
            self.block_node[x as usize] = NO_NODE;
            if x != b {
                also_dropped.push(x);
            }
        }
        self.num_cached -= tail.len();
        if pos == 0 {
            self.remove_empty(node);
        }
    }

    /// Verifies the tree structure and the block index against each other.
    pub fn check_invariants(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("radix cache: {m}")));
        let bs = self.block_size;
        let mut live = vec![false; self.nodes.len()];
        let mut count_blocks = 0usize;
        let mut stack: Vec<u32> = Vec::new();
        for (&ns, &r) in &self.roots {
            let root = &self.nodes[r as usize];
            if root.parent != NO_NODE || !root.blocks.is_empty() || root.ns != ns {
                return bad(format!("malformed root of namespace {ns}"));
            }
            stack.push(r);
        }
        while let Some(n) = stack.pop() {
            if std::mem::replace(&mut live[n as usize], true) {
                return bad(format!("node {n} reached twice"));
            }
            let nd = &self.nodes[n as usize];
            if nd.key.len() != nd.blocks.len() * bs {
                return bad(format!("node {n}: key/blocks length mismatch"));
            }
            if nd.parent != NO_NODE && nd.blocks.is_empty() {
                return bad(format!("non-root node {n} holds no block"));
            }
            for (i, &b) in nd.blocks.iter().enumerate() {
                if self.block_node[b as usize] != n || self.block_pos[b as usize] as usize != i {
                    return bad(format!("block {b} index does not point at node {n}[{i}]"));
                }
            }
            count_blocks += nd.blocks.len();
            if nd.child_first.len() != nd.children.len() {
                return bad(format!("node {n}: child_first out of step"));
            }
            for (j, &c) in nd.children.iter().enumerate() {
                let cn = &self.nodes[c as usize];
                if cn.key.first() != Some(&nd.child_first[j]) {
                    return bad(format!("node {n}: stale first token of child {c}"));
                }
                if cn.parent != n || cn.ns != nd.ns {
                    return bad(format!(
                        "child {c} of {n} has parent {} / wrong ns",
                        cn.parent
                    ));
                }
                for &d in &nd.children[..j] {
                    if self.nodes[d as usize].key[..bs] == cn.key[..bs] {
                        return bad(format!("children {d} and {c} of {n} share a first block"));
                    }
                }
                stack.push(c);
            }
        }
        let num_live = live.iter().filter(|&&x| x).count();
        if num_live != self.num_nodes() {
            return bad(format!(
                "{num_live} reachable nodes != {} live",
                self.num_nodes()
            ));
        }
        let indexed = self.block_node.iter().filter(|&&n| n != NO_NODE).count();
        if count_blocks != self.num_cached || indexed != self.num_cached {
            return bad(format!(
                "{count_blocks} in tree, {indexed} indexed, {} counted",
                self.num_cached
            ));
        }
        Ok(())
    }

    fn new_node(&mut self, parent: u32, ns: u64, key: Vec<u32>, blocks: Vec<u32>) -> u32 {
        let nd = Node {
            parent,
            ns,
            key,
            blocks,
            children: Vec::new(),
            child_first: Vec::new(),
        };
        if let Some(i) = self.free_nodes.pop() {
            self.nodes[i as usize] = nd;
            i
        } else {
            self.nodes.push(nd);
            (self.nodes.len() - 1) as u32
        }
    }

    fn new_leaf(&mut self, parent: u32, ns: u64, tokens: &[u32], b: u32, following: usize) -> u32 {
        let mut key = Vec::with_capacity(tokens.len() * (1 + following));
        key.extend_from_slice(tokens);
        let mut blocks = Vec::with_capacity(1 + following);
        blocks.push(b);
        self.new_node(parent, ns, key, blocks)
    }

    fn add_child(&mut self, parent: u32, child: u32, first: u32) {
        let pn = &mut self.nodes[parent as usize];
        pn.children.push(child);
        pn.child_first.push(first);
    }

    fn set_block(&mut self, b: u32, node: u32, pos: usize) {
        if self.block_node[b as usize] == NO_NODE {
            self.num_cached += 1;
        }
        self.block_node[b as usize] = node;
        self.block_pos[b as usize] = pos as u32;
    }

    /// Splits `node`'s edge before block `at` (0 < at < len): a new upper node takes the
    /// first `at` blocks and becomes `node`'s parent. Returns the upper node.
    fn split(&mut self, node: u32, at: usize) -> u32 {
        let bs = self.block_size;
        let nd = &mut self.nodes[node as usize];
        let (parent, ns) = (nd.parent, nd.ns);
        let upper_key: Vec<u32> = nd.key.drain(..at * bs).collect();
        let upper_blocks: Vec<u32> = nd.blocks.drain(..at).collect();
        let upper = self.new_node(parent, ns, upper_key, upper_blocks);
        let first = self.nodes[node as usize].key[0];
        self.add_child(upper, node, first);
        self.nodes[node as usize].parent = upper;
        for slot in self.nodes[parent as usize].children.iter_mut() {
            if *slot == node {
                *slot = upper;
            }
        }
        for i in 0..self.nodes[upper as usize].blocks.len() {
            let b = self.nodes[upper as usize].blocks[i];
            self.block_node[b as usize] = upper;
        }
        for i in 0..self.nodes[node as usize].blocks.len() {
            let b = self.nodes[node as usize].blocks[i];
            self.block_pos[b as usize] = i as u32;
        }
        upper
    }

    fn drop_subtree(&mut self, n: u32, dropped: &mut Vec<u32>) {
        let mut stack = vec![n];
        while let Some(x) = stack.pop() {
            let nd = std::mem::take(&mut self.nodes[x as usize]);
            for &b in &nd.blocks {
                self.block_node[b as usize] = NO_NODE;
                dropped.push(b);
            }
            self.num_cached -= nd.blocks.len();
            stack.extend_from_slice(&nd.children);
            self.free_nodes.push(x);
        }
    }

    /// Unlinks an emptied non-root node; drops a root left without children.
    fn remove_empty(&mut self, node: u32) {
        let nd = &self.nodes[node as usize];
        let (parent, ns) = (nd.parent, nd.ns);
        if parent == NO_NODE {
            return;
        }
        self.nodes[node as usize] = Node::default();
        self.free_nodes.push(node);
        let pn = &mut self.nodes[parent as usize];
        if let Some(i) = pn.children.iter().position(|&c| c == node) {
            pn.children.swap_remove(i);
            pn.child_first.swap_remove(i);
        }
        let pn = &self.nodes[parent as usize];
        if pn.parent == NO_NODE && pn.children.is_empty() {
            self.roots.remove(&ns);
            self.nodes[parent as usize] = Node::default();
            self.free_nodes.push(parent);
        }
    }
}

#[cfg(test)]
#[path = "radix_cache_tests.rs"]
mod tests;
