//! The radix cache's node plumbing: allocation, leaves, back-pointers, edge splits and the
//! removal of emptied nodes and subtrees. Every function that moves an entry re-points its
//! back-pointers (`block_node`/`block_pos`, `slot_node`/`slot_pos`) in the same call.
//! Costs: O(1) per entry touched; a split is O(edge length).

use super::{Node, RadixCache, NO_BLOCK, NO_NODE, NO_SLOT};

impl RadixCache {
    pub(super) fn new_node(
        &mut self,
        parent: u32,
        ns: u64,
        key: Vec<u32>,
        blocks: Vec<u32>,
        l2: Vec<u32>,
    ) -> u32 {
        let off_l1 = blocks.iter().filter(|&&x| x == NO_BLOCK).count() as u32;
        let nd = Node {
            parent,
            ns,
            key,
            blocks,
            l2,
            off_l1,
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

    pub(super) fn new_leaf(
        &mut self,
        parent: u32,
        ns: u64,
        tokens: &[u32],
        l1: u32,
        l2: u32,
        following: usize,
    ) -> u32 {
        let mut key = Vec::with_capacity(tokens.len() * (1 + following));
        key.extend_from_slice(tokens);
        let mut blocks = Vec::with_capacity(1 + following);
        blocks.push(l1);
        let mut slots = Vec::with_capacity(1 + following);
        slots.push(l2);
        let n = self.new_node(parent, ns, key, blocks, slots);
        self.index_entry(n, 0);
        n
    }

    /// Points the back-pointers of entry `pos` of `node` at it.
    pub(super) fn index_entry(&mut self, node: u32, pos: usize) {
        let (b, s) = {
            let nd = &self.nodes[node as usize];
            (nd.blocks[pos], nd.l2[pos])
        };
        if b != NO_BLOCK {
            self.set_block(b, node, pos);
        }
        if s != NO_SLOT {
            self.set_slot(s, node, pos);
        }
    }

    pub(super) fn add_child(&mut self, parent: u32, child: u32, first: u32) {
        let pn = &mut self.nodes[parent as usize];
        pn.children.push(child);
        pn.child_first.push(first);
    }

    pub(super) fn set_block(&mut self, b: u32, node: u32, pos: usize) {
        if self.block_node[b as usize] == NO_NODE {
            self.num_cached += 1;
        }
        self.block_node[b as usize] = node;
        self.block_pos[b as usize] = pos as u32;
    }

    /// Splits `node`'s edge before entry `at` (0 < at < len): a new upper node takes the
    /// first `at` entries and becomes `node`'s parent. Returns the upper node.
    pub(super) fn split(&mut self, node: u32, at: usize) -> u32 {
        let bs = self.block_size;
        let nd = &mut self.nodes[node as usize];
        let (parent, ns) = (nd.parent, nd.ns);
        let upper_key: Vec<u32> = nd.key.drain(..at * bs).collect();
        let upper_blocks: Vec<u32> = nd.blocks.drain(..at).collect();
        let upper_l2: Vec<u32> = nd.l2.drain(..at).collect();
        nd.off_l1 = nd.blocks.iter().filter(|&&x| x == NO_BLOCK).count() as u32;
        let upper = self.new_node(parent, ns, upper_key, upper_blocks, upper_l2);
        let first = self.nodes[node as usize].key[0];
        self.add_child(upper, node, first);
        self.nodes[node as usize].parent = upper;
        for slot in self.nodes[parent as usize].children.iter_mut() {
            if *slot == node {
                *slot = upper;
            }
        }
        for i in 0..at {
            self.index_entry(upper, i);
        }
        for i in 0..self.nodes[node as usize].blocks.len() {
            self.index_entry(node, i);
        }
        upper
    }

    pub(super) fn drop_subtree(&mut self, n: u32, dropped: &mut Vec<u32>) {
        let mut stack = vec![n];
        while let Some(x) = stack.pop() {
            let nd = std::mem::take(&mut self.nodes[x as usize]);
            self.unindex(&nd.blocks, &nd.l2, dropped);
            stack.extend_from_slice(&nd.children);
            self.free_nodes.push(x);
        }
    }

    /// Unlinks an emptied non-root node; drops a root left without children.
    pub(super) fn remove_empty(&mut self, node: u32) {
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
