//! The KV manager: block pool + per-request block tables + prefix cache, at request level.
//!
//! Callers (the scheduler, the Python bindings) own the tokens; the manager owns blocks. A
//! request's life: `match_prefix` → `admit` (ref the hit, allocate the rest) → `allocate_slots`
//! as it grows → `cache_computed` as its KV gets computed → `free`. `fork` shares a table.
//!
//! Invariants (`check_invariants`): every block's ref count equals the number of tables that
//! hold it plus the pending copy ops that read it; a block is cached in the pool iff the prefix
//! cache names it; free + referenced = all non-null blocks; each table's shape is consistent.
//!
//! Copy-on-write: writing into a partial last block that another table holds, or that is cached
//! (a token-granularity prefix hit ending inside a block) first takes a fresh block and records
//! a `(src, dst)` copy op. The op keeps a reference on `src` until `drain_copy_ops`, so `src`
//! cannot be reused as another op's destination before the copies are applied. Freeing a
//! request cancels its pending ops whose `dst` nobody holds any more (a later drain would
//! otherwise write into a block handed to someone else), and a pending `dst` is never cached
//! (its KV is not there yet).
//!
//! Tokens: each table remembers the tokens its request is known to hold (the prompt given to
//! `admit`, then every full block stated as computed). `cache_computed` and `free` must state
//! the same tokens over that range or are refused, so one request's KV is never published
//! under another's tokens. Cost: one `memcmp` of the stated tokens per call, and 4 bytes per
//! known token. With the prefix cache off nothing is published, so no tokens are kept.
//!
//! Duplicates: when `cache_computed` finds a block's tokens already cached under another block,
//! the request switches to the cached block and frees its own (if no one else holds it), so a
//! request holding a cached block always holds its cached ancestors, which keeps LRU eviction
//! leaf-first.
//!
//! Errors change nothing: every call validates before it mutates. Running out of blocks is
//! `Ok(false)`, also with nothing changed; blocks are evicted only by a call that succeeds.
//! Costs: O(blocks touched) per call, plus the prefix cache's match/insert cost.
//!
//! Files: this one (admission, growth, free, fork, copy ops), `caching` (prefix lookups,
//! publishing computed blocks, eviction), `inspect` (read-only queries and `check_invariants`),
//! `snapshot` (the dashboard's one read-only picture in flat arrays),
//! `retention` (releasing blocks no later step reads), `tiers` (the manager's side of the KV
//! tiers), `tree_check` (tier checks for tests), and the tests (`tests`, `trust_tests`,
//! `props`).

use std::collections::HashMap;

use crate::block_pool::{BlockPool, NULL_BLOCK};
use crate::block_table::{blocks_for, BlockTable};
use crate::error::{KvError, KvResult};
use crate::prefix::{PrefixCache, PrefixMode};

/// Largest pool a manager accepts (2^26 blocks: ~1 billion tokens at block size 16, under
/// 1 GiB of bookkeeping), so a bad argument cannot ask for an allocation that aborts.
pub const MAX_BLOCKS: u32 = 1 << 26;

/// Largest block size a manager accepts.
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

/// Largest request id and namespace (2^63 - 1), here and in the scheduler: ids cross to
/// Python as `int64`, so every id kvcore accepts can also be looked up and reported.
pub const MAX_ID: u64 = i64::MAX as u64;

/// `Err(InvalidArgument)` unless `id` is at most [`MAX_ID`]; `what` names it.
pub(crate) fn check_id(what: &str, id: u64) -> KvResult<()> {
    if id > MAX_ID {
        return Err(KvError::InvalidArgument(format!(
            "{what} must be in 0..2**63, got {id}"
        )));
    }
    Ok(())
}

/// Construction parameters of a [`KvManager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvManagerConfig {
    /// Blocks in the pool, the null block included (at least 2).
    pub num_blocks: u32,
    /// Tokens per block (at least 1).
    pub block_size: u32,
    /// Which prefix cache to run.
    pub prefix_mode: PrefixMode,
}

/// A prefix-cache hit returned by `match_prefix`, consumed by `admit`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Matched tokens (the caller skips computing them).
    pub num_tokens: usize,
    blocks: Vec<u32>,
    ns: u64,
    epoch: u64,
}

impl PrefixHit {
    /// The cached blocks of the hit (the last one may be only partly matched).
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

/// Prefix-cache and allocator counters since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// `match_prefix` calls.
    pub queries: u64,
    /// Tokens offered to `match_prefix`.
    pub query_tokens: u64,
    /// Tokens matched by `match_prefix`.
    pub hit_tokens: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Blocks now cached.
    pub cached_blocks: u64,
    /// Copy-on-write copy ops recorded.
    pub copy_ops: u64,
    /// Duplicate blocks replaced by an already cached twin in `cache_computed`.
    pub deduplicated_blocks: u64,
}

/// Request-level manager of a paged KV cache.
#[derive(Debug, Clone)]
pub struct KvManager {
    block_size: u32,
    pool: BlockPool,
    cache: PrefixCache,
    tables: HashMap<u64, BlockTable>,
    copy_ops: Vec<[u32; 2]>,
    stats: CacheStats,
    /// Bumped on every eviction: a hit from an older epoch may name evicted blocks.
    epoch: u64,
    scratch: Vec<u32>,
    /// Tiers below the pool (None: off); see `tiers`.
    tiers: Option<Box<crate::tiers::Tiers>>,
}

impl KvManager {
    /// A manager with an empty pool. Err for a block size outside 1..=MAX_BLOCK_SIZE or
    /// `num_blocks` outside 2..=MAX_BLOCKS.
    pub fn new(cfg: KvManagerConfig) -> KvResult<Self> {
        if cfg.block_size == 0 || cfg.block_size > MAX_BLOCK_SIZE {
            return Err(KvError::InvalidArgument(format!(
                "block_size must be in 1..={MAX_BLOCK_SIZE}, got {}",
                cfg.block_size
            )));
        }
        if cfg.num_blocks > MAX_BLOCKS {
            return Err(KvError::InvalidArgument(format!(
                "num_blocks must be at most {MAX_BLOCKS}, got {}",
                cfg.num_blocks
            )));
        }
        let pool = BlockPool::new(cfg.num_blocks)?;
        Ok(KvManager {
            block_size: cfg.block_size,
            pool,
            cache: PrefixCache::new(cfg.prefix_mode, cfg.num_blocks, cfg.block_size),
            tables: HashMap::new(),
            copy_ops: Vec::new(),
            stats: CacheStats::default(),
            epoch: 0,
            scratch: Vec::new(),
            tiers: None,
        })
    }

    /// Admits `req`: refs the hit's blocks and allocates so its table covers
    /// `hit.num_tokens + num_new_tokens` tokens, leaving at least `watermark_blocks` free.
    /// `Ok(false)`: not enough blocks, nothing changed. Err (duplicate id, empty or over-long
    /// request, a hit not from `match_prefix(ns, tokens)` or made stale by an eviction since):
    /// nothing changed. `PrefixHit::default()` (no hit) is valid in any namespace; call
    /// `match_prefix` right before `admit` so no other admission evicts the hit in between.
    pub fn admit(
        &mut self,
        req: u64,
        ns: u64,
        tokens: &[u32],
        hit: &PrefixHit,
        num_new_tokens: usize,
        watermark_blocks: u32,
    ) -> KvResult<bool> {
        check_id("request id", req)?;
        check_id("namespace", ns)?;
        if self.tables.contains_key(&req) {
            return Err(KvError::DuplicateRequest(req));
        }
        let bs = self.block_size as usize;
        let total = hit.num_tokens.saturating_add(num_new_tokens);
        if total == 0 {
            return Err(KvError::InvalidArgument(format!(
                "request {req} admits 0 tokens"
            )));
        }
        if total > self.max_tokens() {
            return Err(KvError::TooLong(format!(
                "request {req} needs {total} tokens; the pool holds at most {}",
                self.max_tokens()
            )));
        }
        if hit.num_tokens > tokens.len()
            || (hit.ns != ns && hit.num_tokens > 0)
            || hit.blocks.len() != blocks_for(hit.num_tokens, bs)
        {
            return Err(KvError::InvalidArgument(format!(
                "request {req}: the prefix hit is not for these tokens"
            )));
        }
        let fresh_hit;
        let hit = if hit.epoch == self.epoch || hit.num_tokens == 0 {
            hit
        } else {
            // Evictions since the match: re-match (no stats) and accept only an equal hit.
            let mut blocks = Vec::new();
            let n = self
                .cache
                .match_prefix(ns, tokens, hit.num_tokens, &mut blocks);
            if n != hit.num_tokens {
                return Err(KvError::InvalidArgument(format!(
                    "request {req}: stale prefix hit ({} tokens, {n} still cached); match again",
                    hit.num_tokens
                )));
            }
            fresh_hit = PrefixHit {
                num_tokens: n,
                blocks,
                ns,
                epoch: self.epoch,
            };
            &fresh_hit
        };
        let k = hit.blocks.len();
        let partial = hit.num_tokens % bs != 0;
        let cow = partial && num_new_tokens > 0;
        let kept = if cow { k - 1 } else { k };
        let num_fresh = blocks_for(total, bs) - kept;
        let revived = hit
            .blocks
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        let need = num_fresh as u64 + revived as u64 + watermark_blocks as u64;
        if need > self.pool.num_free() as u64 {
            return Ok(false);
        }
        let mut table = BlockTable::new(ns);
        if self.cache.mode() != PrefixMode::Off {
            table.tokens = tokens.to_vec(); // nothing is published without a prefix cache
        }
        table.blocks.reserve(blocks_for(total, bs));
        for &b in &hit.blocks {
            self.pool.incref(b);
        }
        table.blocks.extend_from_slice(&hit.blocks[..kept]);
        for _ in 0..num_fresh {
            let b = self.allocate_block();
            table.blocks.push(b);
        }
        if cow {
            // The copy op holds the reference taken on the partly matched block above.
            self.copy_ops.push([hit.blocks[k - 1], table.blocks[kept]]);
            self.stats.copy_ops += 1;
        }
        table.num_tokens = total;
        table.num_cached_blocks = hit.num_tokens / bs;
        self.tables.insert(req, table);
        Ok(true)
    }

    /// Grows `req`'s table to cover `num_total_tokens` tokens. A shared or cached partial last
    /// block is copied first (copy-on-write). `Ok(false)`: short of blocks, nothing changed.
    /// Covering fewer tokens than the table already does is a no-op.
    pub fn allocate_slots(&mut self, req: u64, num_total_tokens: usize) -> KvResult<bool> {
        let bs = self.block_size as usize;
        let max = self.max_tokens();
        let t = self.tables.get(&req).ok_or(KvError::UnknownRequest(req))?;
        if num_total_tokens > max {
            return Err(KvError::TooLong(format!(
                "request {req} needs {num_total_tokens} tokens; the pool holds at most {max}"
            )));
        }
        if num_total_tokens <= t.num_tokens {
            return Ok(true);
        }
        let cow = t.has_partial_last(bs) && {
            // Pending copy ops only read `last` before the next forward: they don't share it.
            let last = *t.blocks.last().expect("partial table has a last block");
            let pins = self.copy_ops.iter().filter(|op| op[0] == last).count() as u32;
            self.pool.ref_count(last) - pins > 1 || self.pool.is_cached(last)
        };
        let num_fresh = blocks_for(num_total_tokens, bs) - t.blocks.len() + cow as usize;
        if num_fresh > self.pool.num_free() as usize {
            return Ok(false);
        }
        let mut fresh: Vec<u32> = (0..num_fresh).map(|_| self.allocate_block()).collect();
        let t = self.tables.get_mut(&req).expect("checked above");
        if cow {
            let dst = fresh.remove(0);
            let last = t.blocks.last_mut().expect("partial table has a last block");
            // The table's reference on the old block moves to the copy op.
            self.copy_ops.push([*last, dst]);
            self.stats.copy_ops += 1;
            *last = dst;
        }
        t.blocks.extend_from_slice(&fresh);
        t.num_tokens = num_total_tokens;
        Ok(true)
    }

    /// Releases `req`: caches the full blocks of `tokens` (its computed tokens; may be empty),
    /// then drops each block's reference, last block first, and cancels the pending copy ops
    /// that would write into a block nobody holds any more. Err (nothing changed): unknown id,
    /// too many tokens, or tokens that disagree with what `req` holds.
    pub fn free(&mut self, req: u64, tokens: &[u32]) -> KvResult<()> {
        self.check_tokens(req, tokens)?;
        self.free_checked(req, tokens);
        Ok(())
    }

    /// `free` for tokens that passed `check_tokens` (batch callers check first).
    pub(crate) fn free_checked(&mut self, req: u64, tokens: &[u32]) {
        self.cache_checked(req, tokens);
        let t = self.tables.remove(&req).expect("checked by check_tokens");
        for &b in t.blocks.iter().rev().filter(|&&b| b != NULL_BLOCK) {
            self.pool.decref(b);
        }
        if !self.copy_ops.is_empty() {
            self.cancel_orphan_copies();
        }
    }

    /// Drops pending copy ops whose destination nobody holds (it went back to the pool), with
    /// their hold on the source. Newest first: an op's source may be an older op's destination.
    fn cancel_orphan_copies(&mut self) {
        let mut i = self.copy_ops.len();
        while i > 0 {
            i -= 1;
            let [src, dst] = self.copy_ops[i];
            if self.pool.ref_count(dst) == 0 {
                self.copy_ops.remove(i);
                self.pool.decref(src);
            }
        }
    }

    /// `child` shares every block of `parent` and the tokens they hold. Err: unknown parent,
    /// live child, or a child id above [`MAX_ID`].
    pub fn fork(&mut self, parent: u64, child: u64) -> KvResult<()> {
        check_id("request id", child)?;
        if self.tables.contains_key(&child) {
            return Err(KvError::DuplicateRequest(child));
        }
        let p = self.table(parent)?;
        // Beyond the shared blocks (a prompt not yet allocated) the child may differ.
        let t = BlockTable {
            blocks: p.blocks.clone(),
            num_tokens: p.num_tokens,
            num_cached_blocks: p.num_cached_blocks,
            ns: p.ns,
            tokens: p.tokens[..p.tokens.len().min(p.num_tokens)].to_vec(),
            num_released: p.num_released,
            publish_closed: p.publish_closed,
        };
        for &b in t.blocks.iter().filter(|&&b| b != NULL_BLOCK) {
            self.pool.incref(b);
        }
        self.tables.insert(child, t);
        Ok(())
    }

    /// Appends the pending `(src, dst)` copy ops to `out`, clears them and releases their
    /// hold on `src`. Apply them before the next forward pass.
    pub fn drain_copy_ops(&mut self, out: &mut Vec<[u32; 2]>) {
        for op in self.copy_ops.drain(..) {
            self.pool.decref(op[0]);
            out.push(op);
        }
    }

    fn table(&self, req: u64) -> KvResult<&BlockTable> {
        self.tables.get(&req).ok_or(KvError::UnknownRequest(req))
    }
}

mod caching;
mod inspect;
mod retention;
mod snapshot;
pub use snapshot::KvSnapshot;
mod tiers;
pub use tiers::TieredHit;
mod tree_check;

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;
