//! A request's block table: the blocks that hold its KV, in token order, append-only.
//!
//! ```text
//!   positions  0 .. bs-1 | bs .. 2bs-1 | ... | (n-1)bs .. num_tokens-1 (partial last block)
//!   blocks     [  b0     |     b1      | ... |   b(n-1)                 ]
//!   slot(p) = blocks[p / bs] * bs + p % bs
//! ```
//!
//! Invariants: `blocks.len() == ceil(num_tokens / bs)`; an entry is the null block only for a
//! *released* full block (retention: no layer can see it any more, or a lossy policy dropped
//! it; `num_released` of them, never the partial last block); `num_cached_blocks <= num_tokens
//! / bs` leading full blocks have been offered to the prefix cache. Only the last block may be partial, and only it is ever written again (after a
//! copy-on-write when it is shared or cached). Costs: O(1) per appended block.
//!
//! `tokens` is what the manager knows the request holds: its prompt (given to `admit`) and the
//! tokens of every full block stated as computed since. They never change: a later call that
//! states other tokens over that range is refused, so a caller cannot publish one request's
//! KV under another's tokens.

use crate::error::{KvError, KvResult};

/// The per-request state the KV manager keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    /// Block ids in token order.
    pub blocks: Vec<u32>,
    /// Tokens the table covers (slots assigned).
    pub num_tokens: usize,
    /// Leading full blocks already offered to the prefix cache.
    pub num_cached_blocks: usize,
    /// Namespace of the request's prefix-cache keys.
    pub ns: u64,
    /// Tokens the request is known to hold (prompt, then stated full blocks); never rewritten.
    pub tokens: Vec<u32>,
    /// Entries released (set to the null block) by retention.
    pub num_released: usize,
    /// A lossy policy dropped a block: KV computed from now on is not exact, so nothing more
    /// is published to the prefix cache.
    pub publish_closed: bool,
}

/// Number of blocks of `block_size` tokens needed for `num_tokens` tokens.
pub fn blocks_for(num_tokens: usize, block_size: usize) -> usize {
    num_tokens.div_ceil(block_size)
}

impl BlockTable {
    /// An empty table in namespace `ns`.
    pub fn new(ns: u64) -> Self {
        BlockTable {
            ns,
            ..Default::default()
        }
    }

    /// Blocks the table holds (its non-null entries).
    pub fn num_held(&self) -> usize {
        self.blocks.len() - self.num_released
    }

    /// True when the last block holds fewer than `block_size` tokens (and exists).
    pub fn has_partial_last(&self, block_size: usize) -> bool {
        self.num_tokens % block_size != 0
    }

    /// The slot of token position `pos` (`None` beyond the covered tokens).
    pub fn slot(&self, pos: usize, block_size: usize) -> Option<u64> {
        if pos >= self.num_tokens {
            return None;
        }
        let b = self.blocks[pos / block_size] as u64;
        if b == 0 {
            return None; // released
        }
        Some(b * block_size as u64 + (pos % block_size) as u64)
    }

    /// Checks the shape invariants against `block_size` and a pool of `num_blocks`.
    pub fn check(&self, block_size: usize, num_blocks: u32) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("block table: {m}")));
        if self.blocks.len() != blocks_for(self.num_tokens, block_size) {
            return bad(format!(
                "{} blocks for {} tokens",
                self.blocks.len(),
                self.num_tokens
            ));
        }
        if self.num_cached_blocks > self.num_tokens / block_size {
            return bad(format!(
                "{} cached of {} tokens",
                self.num_cached_blocks, self.num_tokens
            ));
        }
        if self.tokens.len() < self.num_cached_blocks * block_size {
            return bad(format!(
                "{} cached blocks but {} known tokens",
                self.num_cached_blocks,
                self.tokens.len()
            ));
        }
        if let Some(&b) = self.blocks.iter().find(|&&b| b >= num_blocks) {
            return bad(format!("holds invalid block {b}"));
        }
        let full = self.num_tokens / block_size;
        if self.blocks[full.min(self.blocks.len())..].contains(&0) {
            return bad("the partial last block is released".into());
        }
        let nulls = self.blocks.iter().filter(|&&b| b == 0).count();
        if nulls != self.num_released {
            return bad(format!(
                "{nulls} null entries but {} released",
                self.num_released
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_table() {
        let t = BlockTable {
            blocks: vec![7, 3],
            num_tokens: 20,
            num_cached_blocks: 1,
            ns: 0,
            tokens: vec![0; 16],
            ..Default::default()
        };
        assert_eq!(t.slot(0, 16), Some(112));
        assert_eq!(t.slot(15, 16), Some(127));
        assert_eq!(t.slot(16, 16), Some(48));
        assert_eq!(t.slot(19, 16), Some(51));
        assert_eq!(t.slot(20, 16), None);
        assert!(t.has_partial_last(16));
        t.check(16, 8).unwrap();
        assert!(t.check(16, 7).is_err());
        assert_eq!(blocks_for(0, 16), 0);
        assert_eq!(blocks_for(17, 16), 2);
    }

    #[test]
    fn released_entries_are_null_full_blocks() {
        let mut t = BlockTable {
            blocks: vec![0, 3, 5],
            num_tokens: 40,
            num_released: 1,
            ..Default::default()
        };
        t.check(16, 8).unwrap();
        assert_eq!(t.slot(3, 16), None);
        assert_eq!(t.slot(16, 16), Some(48));
        assert_eq!(t.num_held(), 2);
        t.num_released = 0;
        assert!(t.check(16, 8).is_err()); // count disagrees
        t.blocks = vec![4, 3, 0];
        t.num_released = 1;
        assert!(t.check(16, 8).is_err()); // the partial last block
    }
}
