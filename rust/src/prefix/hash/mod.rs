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
//! Tiers (`tiers.rs`): an entry is `(L1 block, L2 slot)`, either may be absent; an entry
//! whose block was evicted and written back to L2 stays with its slot, a block loaded back takes
//! its entry again, and an entry with neither is removed.
//!
//! Invariants: `map[h].l1 == b` iff `hash[b] == Some(h)`, `map[h].l2 == s` iff
//! `slot_hash[s] == Some(h)`; at most one block per hash (a second block with the same content
//! stays uncached). Matching is at block granularity.
//!
//! Costs: `match_prefix` and `insert_block` hash one block per step (O(block_size)) plus one
//! hash-map probe; `evict` is O(1). Evicting an inner block leaves its descendants cached but
//! unreachable until the LRU reaches them (as in vLLM); with leaf-first release this is rare.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::xxh3_128;

use crate::block_pool::NULL_BLOCK;
use crate::prefix::radix::{InsertOutcome, NO_BLOCK, NO_SLOT};

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

type FoldMap = HashMap<u128, Entry, BuildHasherDefault<FoldHasher>>;

/// Where one hashed block's KV lives: its L1 block and/or its L2 slot (`NO_BLOCK`/`NO_SLOT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) l1: u32,
    pub(crate) l2: u32,
}

/// Cached blocks indexed by their chained hash; entries outlive L1 while an L2 slot holds them.
#[derive(Debug, Clone)]
pub struct HashCache {
    block_size: usize,
    map: FoldMap,
    hash: Vec<Option<u128>>,
    scratch: Vec<u8>,
    tokens: Vec<u32>,
    sha256: bool,
    slot_hash: Vec<Option<u128>>,
    slot_tokens: Vec<u32>,
    num_cached: usize,
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
            slot_hash: Vec::new(),
            slot_tokens: Vec::new(),
            num_cached: 0,
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

    /// The token ids an entry's KV holds (from its L1 block, else its L2 slot).
    fn entry_tokens(&self, e: Entry) -> &[u32] {
        if e.l1 != NO_BLOCK {
            return self.tokens_of(e.l1);
        }
        let bs = self.block_size;
        &self.slot_tokens[e.l2 as usize * bs..(e.l2 as usize + 1) * bs]
    }

    /// Number of cached (L1) blocks.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// Whether block `b` is cached here.
    pub fn contains(&self, b: u32) -> bool {
        self.hash[b as usize].is_some()
    }

    /// The chained hash of cached block `b`.
    pub fn hash_of(&self, b: u32) -> Option<u128> {
        self.hash[b as usize]
    }

    /// Longest run of full blocks of `tokens[..max_tokens]` in `ns` cached in L1; appends the
    /// blocks to `out` and returns the number of matched tokens (a multiple of block size).
    pub fn match_prefix(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        self.walk(ns, tokens, max_tokens, out, None)
    }

    /// Offers block `b` (uncached, holding `tokens`) as the child of `parent` (`NULL_BLOCK` =
    /// first block of a sequence in `ns`). An entry only L2 holds takes `b` as its L1 block.
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
        let e = self.map.get(&h).copied();
        if let Some(e) = e {
            if self.entry_tokens(e) != tokens {
                return InsertOutcome::ParentNotCached; // a collision: leave this block uncached
            }
            if e.l1 != NO_BLOCK {
                return InsertOutcome::Existing(e.l1);
            }
        }
        let l2 = e.map_or(NO_SLOT, |e| e.l2);
        self.map.insert(h, Entry { l1: b, l2 });
        self.hash[b as usize] = Some(h);
        self.num_cached += 1;
        let bs = self.block_size;
        self.tokens[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(tokens);
        InsertOutcome::Inserted
    }

    /// Drops cached block `b` from L1 (just evicted by the pool). With `slot` (its KV was
    /// written back there) or a slot already on its entry, the entry stays as an L2 entry.
    pub fn evict(&mut self, b: u32, slot: Option<u32>) {
        let Some(h) = self.hash[b as usize].take() else {
            return;
        };
        self.num_cached -= 1;
        let mut e = self.map[&h];
        e.l1 = NO_BLOCK;
        if let Some(s) = slot.filter(|&s| s != e.l2) {
            if e.l2 != NO_SLOT {
                self.slot_hash[e.l2 as usize] = None;
            }
            e.l2 = s;
            self.name_slot(s, h, b);
        }
        if e.l2 == NO_SLOT {
            self.map.remove(&h);
        } else {
            self.map.insert(h, e);
        }
    }
}

mod tiers;

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
        c.evict(1, None);
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
    fn evicted_entries_stay_on_l2_compare_tokens_and_reattach() {
        let mut c = HashCache::with_sha256(8, 2);
        c.insert_block(0, NULL_BLOCK, &[1, 2], 1);
        c.insert_block(0, 1, &[3, 4], 2);
        c.evict(2, Some(5));
        let (mut l1, mut l2) = (Vec::new(), Vec::new());
        assert_eq!(c.match_tiered(0, &[1, 2, 3, 4], 4, &mut l1, &mut l2), 2);
        assert_eq!((l1, l2), (vec![1], vec![5]));
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4], 4, &mut Vec::new()), 2);
        // A block loaded back re-attaches; the entry keeps its slot.
        assert_eq!(c.insert_block(0, 1, &[3, 4], 7), InsertOutcome::Inserted);
        assert_eq!(c.match_prefix(0, &[1, 2, 3, 4], 4, &mut Vec::new()), 4);
        c.drop_l2(5);
        c.check_invariants().unwrap();
        c.evict(7, None);
        assert_eq!((c.num_cached(), c.num_l2(), c.map.len()), (1, 0, 1));
        assert!(c.attach_l2(0, &[1, 2, 3, 4], 6));
        assert!(
            !c.attach_l2(0, &[1, 2, 3, 4], 3),
            "entry names another slot"
        );
        // A forged collision on an L2-only entry is a miss.
        c.slot_tokens[12..14].copy_from_slice(&[9, 9]);
        let (mut l1, mut l2) = (Vec::new(), Vec::new());
        c.match_tiered(0, &[1, 2, 3, 4], 4, &mut l1, &mut l2);
        assert!(l2.is_empty());
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
