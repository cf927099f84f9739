//! Chained-hash prefix cache: each full block is keyed by a 128-bit hash of
//! (parent block's hash, namespace, the block's tokens), as vLLM's prefix caching keys blocks.
//!
//! ```text
//!   h0 = H(ROOT_HASH, ns, tokens[0..bs])   h1 = H(h0, ns, tokens[bs..2bs])   ...
//! ```
//!
//! The hash is xxh3-128 over the little-endian bytes of parent (16) | ns (8) | tokens (4 each):
//! deterministic across processes and machines (no seed), so the hashes can name blocks in KV
//! events, routing and cross-instance lookups. A namespace is part of every hash, so no hit
//! crosses namespaces.
//!
//! Invariants: `map[h] == b` iff `hash[b] == Some(h)`; at most one block per hash (a second
//! block with the same content stays uncached). Matching is at block granularity.
//!
//! Costs: `match_prefix` and `insert_block` hash one block per step (O(block_size)) plus one
//! hash-map probe; `evict` is O(1). Evicting an inner block leaves its descendants cached but
//! unreachable until the LRU reaches them (as in vLLM); with leaf-first release this is rare.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_128;

use crate::block_pool::NULL_BLOCK;
use crate::error::{KvError, KvResult};
use crate::radix_cache::InsertOutcome;

/// Parent hash of the first block of every sequence.
pub const ROOT_HASH: u128 = 0;

/// The chained block hash of one block of tokens.
pub fn block_hash(parent: u128, ns: u64, tokens: &[u32], scratch: &mut Vec<u8>) -> u128 {
    scratch.clear();
    scratch.extend_from_slice(&parent.to_le_bytes());
    scratch.extend_from_slice(&ns.to_le_bytes());
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_128(scratch)
}

/// Cached blocks indexed by their chained hash.
#[derive(Debug, Clone)]
pub struct HashCache {
    block_size: usize,
    map: HashMap<u128, u32>,
    hash: Vec<Option<u128>>,
    scratch: Vec<u8>,
}

impl HashCache {
    /// An empty cache for a pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        HashCache {
            block_size: block_size as usize,
            map: HashMap::new(),
            hash: vec![None; num_blocks as usize],
            scratch: Vec::with_capacity(24 + 4 * block_size as usize),
        }
    }

    /// Number of cached blocks.
    pub fn num_cached(&self) -> usize {
        self.map.len()
    }

    /// Whether block `b` is cached here.
    pub fn contains(&self, b: u32) -> bool {
        self.hash[b as usize].is_some()
    }

    /// The chained hash of cached block `b`.
    pub fn hash_of(&self, b: u32) -> Option<u128> {
        self.hash[b as usize]
    }

    /// Longest cached run of full blocks of `tokens[..max_tokens]` in `ns`; appends the
    /// blocks to `out` and returns the number of matched tokens (a multiple of block size).
    pub fn match_prefix(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        let bs = self.block_size;
        let limit = tokens.len().min(max_tokens);
        let mut parent = ROOT_HASH;
        let mut n = 0;
        for chunk in tokens[..limit].chunks_exact(bs) {
            let h = block_hash(parent, ns, chunk, &mut self.scratch);
            match self.map.get(&h) {
                Some(&b) => out.push(b),
                None => break,
            }
            parent = h;
            n += bs;
        }
        n
    }

    /// Offers block `b` (uncached, holding `tokens`) as the child of `parent` (`NULL_BLOCK` =
    /// first block of a sequence in `ns`).
    pub fn insert_block(&mut self, ns: u64, parent: u32, tokens: &[u32], b: u32) -> InsertOutcome {
        debug_assert_eq!(tokens.len(), self.block_size);
        let ph = if parent == NULL_BLOCK {
            ROOT_HASH
        } else {
            match self.hash[parent as usize] {
                Some(h) => h,
                None => return InsertOutcome::ParentNotCached,
            }
        };
        let h = block_hash(ph, ns, tokens, &mut self.scratch);
        if let Some(&c) = self.map.get(&h) {
            return InsertOutcome::Existing(c);
        }
        self.map.insert(h, b);
        self.hash[b as usize] = Some(h);
        InsertOutcome::Inserted
    }

    /// Drops cached block `b` (just evicted by the pool).
    pub fn evict(&mut self, b: u32) {
        if let Some(h) = self.hash[b as usize].take() {
            self.map.remove(&h);
        }
    }

    /// Verifies that the map and the per-block hashes agree.
    pub fn check_invariants(&self) -> KvResult<()> {
        for (&h, &b) in &self.map {
            if self.hash.get(b as usize).copied().flatten() != Some(h) {
                return Err(KvError::Invariant(format!(
                    "hash cache: block {b} not keyed by its hash"
                )));
            }
        }
        let n = self.hash.iter().filter(|h| h.is_some()).count();
        if n != self.map.len() {
            return Err(KvError::Invariant(format!(
                "hash cache: {n} hashed blocks, {} keys",
                self.map.len()
            )));
        }
        Ok(())
    }
}
