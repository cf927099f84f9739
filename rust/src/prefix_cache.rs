//! The prefix cache behind the KV manager: off, radix tree, or chained block hashes.
//!
//! One enum with the same four operations in every mode (match, offer a block, evict a block,
//! check), so the manager and the benchmarks can switch modes on one trace. The modes differ in
//! granularity: radix matches at token granularity, hash at block granularity.
//!
//! Costs: those of `RadixCache` / `HashCache`; `Off` does nothing in O(1).

use crate::error::{KvError, KvResult};
use crate::hash_cache::HashCache;
use crate::radix_cache::{InsertOutcome, RadixCache};

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

    /// Drops evicted block `b`; blocks that stop being cached with it go to `also_dropped`.
    pub fn evict(&mut self, b: u32, also_dropped: &mut Vec<u32>) {
        match self {
            PrefixCache::Off => {}
            PrefixCache::Radix(c) => c.evict(b, also_dropped),
            PrefixCache::Hash(c) => c.evict(b),
        }
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
