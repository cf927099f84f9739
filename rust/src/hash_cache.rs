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
//! With `with_sha256` the hash is SHA-256 over the same bytes, truncated to 128 bits (keys that
//! are safe to share between processes and tenants). In both modes every cached block keeps its
//! token ids and a hash match counts only when they are equal (a collision is a miss and the
//! colliding block stays uncached), so a hash alone never reuses a block.
//!
//! Invariants: `map[h] == b` iff `hash[b] == Some(h)`; at most one block per hash (a second
//! block with the same content stays uncached). Matching is at block granularity.
//!
//! Costs: `match_prefix` and `insert_block` hash one block per step (O(block_size)) plus one
//! hash-map probe; `evict` is O(1). Evicting an inner block leaves its descendants cached but
//! unreachable until the LRU reaches them (as in vLLM); with leaf-first release this is rare.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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
    // Two tokens per 8-byte store (same bytes as 4-byte stores): xxh3 then reads whole words
    // without store-forwarding stalls.
    let mut pairs = tokens.chunks_exact(2);
    for p in &mut pairs {
        scratch.extend_from_slice(&(p[0] as u64 | (p[1] as u64) << 32).to_le_bytes());
    }
    if let [t] = pairs.remainder() {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_128(scratch)
}

/// Hash-map hasher for keys that are already uniform 128-bit hashes: folds them to 64 bits
/// instead of running SipHash over them again.
#[derive(Default, Clone, Copy)]
pub struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u128 keys are hashed here; keep a correct (if slow) path for anything else.
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u128(&mut self, x: u128) {
        self.0 = (x as u64) ^ ((x >> 64) as u64);
    }
}

type FoldMap = HashMap<u128, u32, BuildHasherDefault<FoldHasher>>;

/// Cached blocks indexed by their chained hash.
#[derive(Debug, Clone)]
pub struct HashCache {
    block_size: usize,
    map: FoldMap,
    hash: Vec<Option<u128>>,
    scratch: Vec<u8>,
    tokens: Vec<u32>,
    sha256: bool,
}

impl HashCache {
    /// An empty cache for a pool of `num_blocks` blocks of `block_size` tokens.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        HashCache {
            block_size: block_size as usize,
            map: FoldMap::with_capacity_and_hasher(num_blocks as usize, Default::default()),
            hash: vec![None; num_blocks as usize],
            scratch: Vec::with_capacity(24 + 4 * block_size as usize),
            tokens: vec![0; num_blocks as usize * block_size as usize],
            sha256: false,
        }
    }

    /// An empty cache whose chained hash is SHA-256 (truncated to 128 bits).
    pub fn with_sha256(num_blocks: u32, block_size: u32) -> Self {
        HashCache {
            sha256: true,
            ..HashCache::new(num_blocks, block_size)
        }
    }

    /// Whether the chained hash is SHA-256.
    pub fn is_sha256(&self) -> bool {
        self.sha256
    }

    fn hash(&mut self, parent: u128, ns: u64, tokens: &[u32]) -> u128 {
        if !self.sha256 {
            return block_hash(parent, ns, tokens, &mut self.scratch);
        }
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(parent.to_le_bytes());
        h.update(ns.to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let d: [u8; 32] = h.finalize().into();
        u128::from_le_bytes(d[..16].try_into().expect("16 bytes"))
    }

    fn tokens_of(&self, b: u32) -> &[u32] {
        let bs = self.block_size;
        &self.tokens[b as usize * bs..(b as usize + 1) * bs]
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
            let h = self.hash(parent, ns, chunk);
            match self.map.get(&h) {
                Some(&b) if self.tokens_of(b) == chunk => out.push(b),
                _ => break,
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
        let h = self.hash(ph, ns, tokens);
        if let Some(&c) = self.map.get(&h) {
            if self.tokens_of(c) != tokens {
                return InsertOutcome::ParentNotCached; // a collision: leave this block uncached
            }
            return InsertOutcome::Existing(c);
        }
        self.map.insert(h, b);
        self.hash[b as usize] = Some(h);
        let bs = self.block_size;
        self.tokens[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(tokens);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hashes_match_whole_blocks_per_namespace() {
        let mut c = HashCache::new(8, 2);
        assert_eq!(
            c.insert_block(0, NULL_BLOCK, &[1, 2], 1),
            InsertOutcome::Inserted
        );
        assert_eq!(c.insert_block(0, 1, &[3, 4], 2), InsertOutcome::Inserted);
        assert_eq!(
            c.insert_block(0, NULL_BLOCK, &[1, 2], 5),
            InsertOutcome::Existing(1)
        );
        assert_eq!(
            c.insert_block(0, 7, &[1, 2], 6),
            InsertOutcome::ParentNotCached
        );
        let mut out = Vec::new();
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4, 5], 5, &mut out), 4);
        assert_eq!(out, vec![1, 2]);
        out.clear();
        assert_eq!(c.match_prefix(0, &[1, 2, 3], 3, &mut out), 2);
        assert_eq!(c.match_prefix(1, &[1, 2, 3, 4], 4, &mut Vec::new()), 0);
        // Same tokens after a different parent: a different hash.
        assert_eq!(c.match_prefix(0, &[3, 4], 2, &mut Vec::new()), 0);
        c.evict(1);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4], 4, &mut Vec::new()), 0);
        assert_eq!(c.num_cached(), 1);
        c.check_invariants().unwrap();
    }

    #[test]
    fn sha256_mode_matches_like_xxh3_and_compares_tokens() {
        let mut c = HashCache::with_sha256(8, 2);
        assert_eq!(
            c.insert_block(0, NULL_BLOCK, &[1, 2], 1),
            InsertOutcome::Inserted
        );
        assert_eq!(c.insert_block(0, 1, &[3, 4], 2), InsertOutcome::Inserted);
        let mut out = Vec::new();
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4], 4, &mut out), 4);
        assert_eq!(out, vec![1, 2]);
        // A forged collision (same hash, other tokens) is a miss, never a reuse.
        let h = c.hash_of(1).unwrap();
        c.tokens[2..4].copy_from_slice(&[9, 9]);
        assert_eq!(c.match_prefix(0, &[1, 2], 2, &mut Vec::new()), 0);
        assert_eq!(
            c.insert_block(0, NULL_BLOCK, &[1, 2], 5),
            InsertOutcome::ParentNotCached
        );
        assert_eq!(c.hash_of(1), Some(h));
        assert!(c.is_sha256() && !HashCache::new(8, 2).is_sha256());
        c.check_invariants().unwrap();
    }

    #[test]
    fn word_stores_hash_the_same_bytes_as_token_stores() {
        let mut scratch = Vec::new();
        for tokens in [&[7u32, 8, 9][..], &[1, 2, 3, 4], &[]] {
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&5u128.to_le_bytes());
            bytes.extend_from_slice(&9u64.to_le_bytes());
            for t in tokens {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            assert_eq!(block_hash(5, 9, tokens, &mut scratch), xxh3_128(&bytes));
        }
    }
}
