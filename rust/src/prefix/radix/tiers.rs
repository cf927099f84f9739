//! The radix cache's tier side: one walk that reports a prefix per tier, L2 entries (attach,
//! drop), and the invariant check over both kinds of back-pointers.
//!
//! A walk follows the exact path of the query's full blocks (children differ in their first
//! block, so the path is unique). Its L1 part is the leading run of entries with an L1 block,
//! extended at token granularity by the best partly matching L1 entry where the run ends; its
//! L2 part (`match_tiered` only) continues from there over the entries that hold an L2 slot.
//! An entry with both an L1 block and an L2 slot (a block loaded from L2 keeps its slot while
//! L2 does) counts as L1. Costs: O(matched tokens + children scanned), like the L1-only match.

use super::{common_prefix, RadixCache, NO_BLOCK, NO_NODE, NO_SLOT};
use crate::error::{KvError, KvResult};

impl RadixCache {
    /// Entries that reference an L2 slot.
    pub fn num_l2(&self) -> usize {
        self.num_l2
    }

    /// One walk over `tokens[..max_tokens]` in `ns`: appends the L1 blocks of the longest L1
    /// prefix (token granularity) to `l1` and, after its last full block, the L2 slots of the
    /// following full blocks that L2 holds to `l2`. Returns the L1 prefix length in tokens.
    pub fn match_tiered(
        &self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        l1: &mut Vec<u32>,
        l2: &mut Vec<u32>,
    ) -> usize {
        self.walk(ns, tokens, max_tokens, l1, Some(l2))
    }

    pub(super) fn walk(
        &self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        l1: &mut Vec<u32>,
        mut l2: Option<&mut Vec<u32>>,
    ) -> usize {
        let limit = tokens.len().min(max_tokens);
        let Some(&root) = self.roots.get(&ns) else {
            return 0;
        };
        let bs = self.block_size;
        let (mut node, mut t, mut l1_tokens, mut in_l1) = (root, 0usize, 0usize, true);
        while t < limit {
            let rest = &tokens[t..limit];
            let exact = self.exact_child(node, rest);
            if exact == NO_NODE {
                if in_l1 {
                    l1_tokens += self.partial_child(node, rest, NO_NODE, l1);
                }
                break;
            }
            let c = &self.nodes[exact as usize];
            let l = common_prefix(&c.key, rest);
            let full = l / bs;
            if in_l1 && c.off_l1 == 0 {
                l1.extend_from_slice(&c.blocks[..full]);
                l1_tokens += full * bs;
            } else {
                for j in 0..full {
                    if in_l1 {
                        if c.blocks[j] != NO_BLOCK {
                            l1.push(c.blocks[j]);
                            l1_tokens += bs;
                            continue;
                        }
                        in_l1 = false;
                        if j == 0 {
                            l1_tokens += self.partial_child(node, rest, exact, l1);
                        }
                    }
                    match l2.as_deref_mut() {
                        Some(v) if c.l2[j] != NO_SLOT => v.push(c.l2[j]),
                        _ => return l1_tokens,
                    }
                }
            }
            t += full * bs;
            if full < c.blocks.len() {
                // The exact path ends inside this edge: its next entry may match in part.
                let p = l - full * bs;
                if in_l1 && p > 0 && c.blocks[full] != NO_BLOCK {
                    l1.push(c.blocks[full]);
                    l1_tokens += p;
                }
                break;
            }
            node = exact;
        }
        l1_tokens
    }

    /// The child of `node` whose first block equals `rest`'s first block, or `NO_NODE`.
    fn exact_child(&self, node: u32, rest: &[u32]) -> u32 {
        let bs = self.block_size;
        if rest.len() < bs {
            return NO_NODE;
        }
        let nd = &self.nodes[node as usize];
        for (&c, &f) in nd.children.iter().zip(&nd.child_first) {
            if f == rest[0] && self.nodes[c as usize].key[..bs] == rest[..bs] {
                return c;
            }
        }
        NO_NODE
    }

    /// The L1 child of `node` (other than `skip`) whose first block shares the longest prefix
    /// with `rest` (ties: lowest block id): pushes its block, returns the shared length.
    fn partial_child(&self, node: u32, rest: &[u32], skip: u32, out: &mut Vec<u32>) -> usize {
        let bs = self.block_size;
        let nd = &self.nodes[node as usize];
        let (mut best, mut best_len) = (NO_BLOCK, 0usize);
        for (&c, &f) in nd.children.iter().zip(&nd.child_first) {
            let cn = &self.nodes[c as usize];
            if f != rest[0] || c == skip || cn.blocks[0] == NO_BLOCK {
                continue;
            }
            let l = common_prefix(&cn.key[..bs], rest);
            if l > best_len || (l == best_len && cn.blocks[0] < best) {
                (best, best_len) = (cn.blocks[0], l);
            }
        }
        if best != NO_BLOCK {
            out.push(best);
        }
        best_len
    }

    /// Names L2 slot `s` on the entry of the last block of `tokens` (whole blocks) in `ns`,
    /// creating the entry when the path to it exists. False (nothing changed): the path is
    /// missing, or the entry names another slot.
    pub fn attach_l2(&mut self, ns: u64, tokens: &[u32], s: u32) -> bool {
        let bs = self.block_size;
        let n = tokens.len() / bs;
        if n == 0 || tokens.len() % bs != 0 || self.slot_at(s).is_some() {
            return false;
        }
        let root = match self.roots.get(&ns) {
            Some(&r) => r,
            None if n == 1 => self.root(ns),
            None => return false,
        };
        let (mut node, mut pos) = (root, 0usize);
        for chunk in tokens[..(n - 1) * bs].chunks_exact(bs) {
            let nd = &self.nodes[node as usize];
            if pos < nd.blocks.len() {
                if nd.key[pos * bs..(pos + 1) * bs] != *chunk {
                    return false;
                }
                pos += 1;
                continue;
            }
            match self.exact_child(node, chunk) {
                NO_NODE => return false,
                c => (node, pos) = (c, 1),
            }
        }
        let last = &tokens[(n - 1) * bs..];
        let (m, p, created) = self.place(ns, node, pos, last, 0, NO_BLOCK, s);
        if created {
            return true;
        }
        if self.nodes[m as usize].l2[p] != NO_SLOT {
            return false;
        }
        self.set_slot(s, m, p);
        true
    }

    /// L2 slot `s` was evicted (or reused): its entry forgets it; an entry left without KV goes,
    /// with everything below it (L1 blocks dropped that way are appended to `dropped`).
    pub fn drop_l2(&mut self, s: u32, dropped: &mut Vec<u32>) {
        let Some((node, pos)) = self.slot_at(s) else {
            return;
        };
        self.slot_node[s as usize] = NO_NODE;
        self.num_l2 -= 1;
        let nd = &mut self.nodes[node as usize];
        nd.l2[pos] = NO_SLOT;
        if nd.blocks[pos] != NO_BLOCK {
            return;
        }
        self.drop_entry(node, pos, dropped);
    }

    /// The entry naming slot `s`.
    fn slot_at(&self, s: u32) -> Option<(u32, usize)> {
        match self.slot_node.get(s as usize) {
            Some(&n) if n != NO_NODE => Some((n, self.slot_pos[s as usize] as usize)),
            _ => None,
        }
    }

    /// Names slot `s` on entry `pos` of `node` (replacing the entry's previous slot).
    pub(super) fn set_slot(&mut self, s: u32, node: u32, pos: usize) {
        let old = self.nodes[node as usize].l2[pos];
        if old != s && old != NO_SLOT {
            self.slot_node[old as usize] = NO_NODE;
            self.num_l2 -= 1;
        }
        self.nodes[node as usize].l2[pos] = s;
        if self.slot_node.len() <= s as usize {
            self.slot_node.resize(s as usize + 1, NO_NODE);
            self.slot_pos.resize(s as usize + 1, 0);
        }
        debug_assert!(self.slot_at(s).is_none_or(|e| e == (node, pos)));
        if self.slot_node[s as usize] == NO_NODE {
            self.num_l2 += 1;
        }
        self.slot_node[s as usize] = node;
        self.slot_pos[s as usize] = pos as u32;
    }

    /// Every entry as (namespace, tokens of its path up to and including its block, L1 block
    /// or `NO_BLOCK`, L2 slot or `NO_SLOT`): for brute-force checks. O(tree tokens × depth).
    pub fn entries(&self) -> Vec<(u64, Vec<u32>, u32, u32)> {
        let bs = self.block_size;
        let mut out = Vec::new();
        let mut stack: Vec<(u32, Vec<u32>)> = self.roots.values().map(|&r| (r, vec![])).collect();
        while let Some((n, mut path)) = stack.pop() {
            let nd = &self.nodes[n as usize];
            for i in 0..nd.blocks.len() {
                path.extend_from_slice(&nd.key[i * bs..(i + 1) * bs]);
                out.push((nd.ns, path.clone(), nd.blocks[i], nd.l2[i]));
            }
            stack.extend(nd.children.iter().map(|&c| (c, path.clone())));
        }
        out
    }

    /// Verifies the tree structure and both back-pointer indexes against each other.
    pub fn check_invariants(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("radix cache: {m}")));
        let bs = self.block_size;
        let mut live = vec![false; self.nodes.len()];
        let (mut count_blocks, mut count_slots) = (0usize, 0usize);
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
            if nd.key.len() != nd.blocks.len() * bs || nd.l2.len() != nd.blocks.len() {
                return bad(format!("node {n}: key/blocks/l2 length mismatch"));
            }
            if nd.parent != NO_NODE && nd.blocks.is_empty() {
                return bad(format!("non-root node {n} holds no block"));
            }
            let off = nd.blocks.iter().filter(|&&b| b == NO_BLOCK).count();
            if off != nd.off_l1 as usize {
                return bad(format!(
                    "node {n}: off_l1 {} but {off} entries off L1",
                    nd.off_l1
                ));
            }
            for (i, (&b, &s)) in nd.blocks.iter().zip(&nd.l2).enumerate() {
                if b == NO_BLOCK && s == NO_SLOT {
                    return bad(format!("entry {n}[{i}] holds KV on no tier"));
                }
                if b != NO_BLOCK
                    && (self.block_node[b as usize] != n
                        || self.block_pos[b as usize] as usize != i)
                {
                    return bad(format!("block {b} index does not point at node {n}[{i}]"));
                }
                if s != NO_SLOT && self.slot_at(s) != Some((n, i)) {
                    return bad(format!("slot {s} index does not point at node {n}[{i}]"));
                }
            }
            count_blocks += nd.blocks.len() - off;
            count_slots += nd.l2.iter().filter(|&&s| s != NO_SLOT).count();
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
        let slots = self.slot_node.iter().filter(|&&n| n != NO_NODE).count();
        if count_slots != self.num_l2 || slots != self.num_l2 {
            return bad(format!(
                "{count_slots} slots in tree, {slots} indexed, {} counted",
                self.num_l2
            ));
        }
        Ok(())
    }
}
