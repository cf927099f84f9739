//! The prefix cache behind the KV manager: off, radix tree, or chained block hashes.
//!
//! One enum with the same four operations in every mode (match, offer a block, evict a block,
//! check), so the manager and the benchmarks can switch modes on one trace. The modes differ in
//! granularity: radix matches at token granularity, hash at block granularity.
//!
//! Costs: those of `RadixCache` / `HashCache`; `Off` does nothing in O(1).

pub mod hash;
pub mod radix;

use crate::error::{KvError, KvResult};
use hash::HashCache;
use radix::{InsertOutcome, RadixCache};

/// Which prefix cache a manager runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixMode {
    /// No prefix caching: every block is private to its request.
    Off,
    /// Radix tree over token ids (token-granularity hits).
    Radix,
    /// Chained 128-bit block hashes (block-granularity hits, vLLM-compatible keys), xxh3-128.
    Hash,
    /// Chained block hashes with SHA-256 (truncated to 128 bits): collision-resistant keys.
    HashSha256,
}

impl PrefixMode {
    /// Parses "off", "radix", "hash" (xxh3) or "hash_sha256".
    pub fn parse(s: &str) -> KvResult<Self> {
        match s {
            "off" | "none" => Ok(PrefixMode::Off),
            "radix" => Ok(PrefixMode::Radix),
            "hash" => Ok(PrefixMode::Hash),
            "hash_sha256" => Ok(PrefixMode::HashSha256),
            _ => Err(KvError::InvalidArgument(format!(
                "prefix mode must be 'off', 'radix', 'hash' or 'hash_sha256', got {s:?}"
            ))),
        }
    }

    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            PrefixMode::Off => "off",
            PrefixMode::Radix => "radix",
            PrefixMode::Hash => "hash",
            PrefixMode::HashSha256 => "hash_sha256",
        }
    }
}

/// A prefix cache in one of the three modes.
#[derive(Debug, Clone)]
pub enum PrefixCache {
    /// Caching disabled.
    Off,
    /// Radix tree mode.
    Radix(RadixCache),
    /// Chained-hash mode.
    Hash(HashCache),
}

impl PrefixCache {
    /// An empty cache of `mode` for `num_blocks` blocks of `block_size` tokens.
    pub fn new(mode: PrefixMode, num_blocks: u32, block_size: u32) -> Self {
        match mode {
            PrefixMode::Off => PrefixCache::Off,
            PrefixMode::Radix => PrefixCache::Radix(RadixCache::new(num_blocks, block_size)),
            PrefixMode::Hash => PrefixCache::Hash(HashCache::new(num_blocks, block_size)),
            PrefixMode::HashSha256 => {
                PrefixCache::Hash(HashCache::with_sha256(num_blocks, block_size))
            }
        }
    }

    /// The mode of this cache.
    pub fn mode(&self) -> PrefixMode {
        match self {
            PrefixCache::Off => PrefixMode::Off,
            PrefixCache::Radix(_) => PrefixMode::Radix,
            PrefixCache::Hash(c) if c.is_sha256() => PrefixMode::HashSha256,
            PrefixCache::Hash(_) => PrefixMode::Hash,
        }
    }

    /// Longest cached prefix of `tokens[..max_tokens]`; appends its blocks to `out`.
    pub fn match_prefix(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        out: &mut Vec<u32>,
    ) -> usize {
        match self {
            PrefixCache::Off => 0,
            PrefixCache::Radix(c) => c.match_prefix(ns, tokens, max_tokens, out),
            PrefixCache::Hash(c) => c.match_prefix(ns, tokens, max_tokens, out),
        }
    }

    /// Offers block `b` holding `tokens` as the child of cached block `parent` (or the root);
    /// `following` blocks will be offered next (a capacity hint).
    pub fn insert_block(
        &mut self,
        ns: u64,
        parent: u32,
        tokens: &[u32],
        b: u32,
        following: usize,
    ) -> InsertOutcome {
        match self {
            PrefixCache::Off => InsertOutcome::ParentNotCached,
            PrefixCache::Radix(c) => c.insert_block(ns, parent, tokens, b, following),
            PrefixCache::Hash(c) => c.insert_block(ns, parent, tokens, b),
        }
    }

    /// Drops evicted block `b` from L1; with `slot` (written back there) its entry stays as an
    /// L2 entry. Blocks that stop being cached with it go to `also_dropped`.
    pub fn evict(&mut self, b: u32, slot: Option<u32>, also_dropped: &mut Vec<u32>) {
        match self {
            PrefixCache::Off => {}
            PrefixCache::Radix(c) => c.evict(b, slot, also_dropped),
            PrefixCache::Hash(c) => c.evict(b, slot),
        }
    }

    /// One walk: the L1 prefix (blocks to `l1`, token count returned, as `match_prefix`) and
    /// the L2 slots of the full blocks right after its last full block (to `l2`).
    pub fn match_tiered(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        l1: &mut Vec<u32>,
        l2: &mut Vec<u32>,
    ) -> usize {
        match self {
            PrefixCache::Off => 0,
            PrefixCache::Radix(c) => c.match_tiered(ns, tokens, max_tokens, l1, l2),
            PrefixCache::Hash(c) => c.match_tiered(ns, tokens, max_tokens, l1, l2),
        }
    }

    /// Names L2 slot `s` on the entry of the last block of `tokens` (whole blocks); false when
    /// the path is not in the cache (radix) or the entry disagrees.
    pub fn attach_l2(&mut self, ns: u64, tokens: &[u32], s: u32) -> bool {
        match self {
            PrefixCache::Off => false,
            PrefixCache::Radix(c) => c.attach_l2(ns, tokens, s),
            PrefixCache::Hash(c) => c.attach_l2(ns, tokens, s),
        }
    }

    /// L2 slot `s` was evicted or reused: entries forget it; L1 blocks that stop being cached
    /// (their path lost every tier) go to `dropped`.
    pub fn drop_l2(&mut self, s: u32, dropped: &mut Vec<u32>) {
        match self {
            PrefixCache::Off => {}
            PrefixCache::Radix(c) => c.drop_l2(s, dropped),
            PrefixCache::Hash(c) => c.drop_l2(s),
        }
    }

    /// Entries that name an L2 slot.
    pub fn num_l2(&self) -> usize {
        match self {
            PrefixCache::Off => 0,
            PrefixCache::Radix(c) => c.num_l2(),
            PrefixCache::Hash(c) => c.num_l2(),
        }
    }

    /// Brute force, for tests: (L1 block, L2 slot) of the entry of each leading full block of
    /// `tokens` that has one, found without the walk (radix: a scan of every entry).
    pub fn brute_entries(&mut self, ns: u64, tokens: &[u32], bs: usize) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        match self {
            PrefixCache::Off => {}
            PrefixCache::Radix(c) => {
                let all: std::collections::HashMap<(u64, Vec<u32>), (u32, u32)> = c
                    .entries()
                    .into_iter()
                    .map(|(n, p, b, s)| ((n, p), (b, s)))
                    .collect();
                for k in 1..=tokens.len() / bs {
                    match all.get(&(ns, tokens[..k * bs].to_vec())) {
                        Some(&e) => out.push(e),
                        None => break,
                    }
                }
            }
            PrefixCache::Hash(c) => {
                for k in 1..=tokens.len() / bs {
                    match c.entry_of_path(ns, &tokens[..k * bs]) {
                        Some(e) => out.push(e),
                        None => break,
                    }
                }
            }
        }
        out
    }

    /// Whether block `b` is cached.
    pub fn contains(&self, b: u32) -> bool {
        match self {
            PrefixCache::Off => false,
            PrefixCache::Radix(c) => c.contains(b),
            PrefixCache::Hash(c) => c.contains(b),
        }
    }

    /// Number of cached blocks.
    pub fn num_cached(&self) -> usize {
        match self {
            PrefixCache::Off => 0,
            PrefixCache::Radix(c) => c.num_cached(),
            PrefixCache::Hash(c) => c.num_cached(),
        }
    }

    /// The chained hash of cached block `b` (hash mode only).
    pub fn block_hash(&self, b: u32) -> Option<u128> {
        match self {
            PrefixCache::Hash(c) => c.hash_of(b),
            _ => None,
        }
    }

    /// Checks the cache's own invariants.
    pub fn check_invariants(&self) -> KvResult<()> {
        match self {
            PrefixCache::Off => Ok(()),
            PrefixCache::Radix(c) => c.check_invariants(),
            PrefixCache::Hash(c) => c.check_invariants(),
        }
    }
}
