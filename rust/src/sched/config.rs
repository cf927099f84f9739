//! Scheduler configuration and its validation.
//!
//! Every limit is checked once in [`SchedulerConfig::validate`]; a scheduler built from a bad
//! configuration is refused with `InvalidArgument`. The watermark is a fraction of the pool that
//! admission keeps free, converted once to a block count.

use crate::error::{KvError, KvResult};
use crate::prefix::PrefixMode;

/// Most KV cache groups (block tables per sequence).
pub const MAX_GROUPS: usize = 16;

/// The KV-manager id of group `g`'s table of sequence `kv_id` (group 0: `kv_id` itself).
pub fn group_kv_id(kv_id: u64, g: usize) -> u64 {
    kv_id | ((g as u64) << 56)
}

/// Order in which waiting requests are admitted and running ones are preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served: arrival order only.
    Fcfs,
    /// Smaller `priority` first, then arrival order.
    Priority,
}

/// Everything the scheduler needs to know up front.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Blocks in the pool, the null block included.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Prefix cache mode of the KV manager.
    pub prefix_mode: PrefixMode,
    /// Token budget of one step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: u32,
    /// Most sequences running at once (the `n` samples of a request count `n`).
    pub max_num_seqs: u32,
    /// Most tokens (prompt + output) a sequence may hold.
    pub max_model_len: u32,
    /// Admission and preemption order.
    pub policy: Policy,
    /// Cap on prefill tokens per sequence per step; 0 = only the step budget caps a chunk.
    pub long_prefill_token_threshold: u32,
    /// Split prompts over steps (vLLM's `enable_chunked_prefill`). Off: a prompt is computed
    /// in one step or waits, so the budget must hold `max_model_len` tokens.
    pub enable_chunked_prefill: bool,
    /// Fraction of the pool that admission keeps free, in `[0, 1)`.
    pub watermark: f64,
    /// End-of-sequence token id, if the model has one.
    pub eos_token_id: Option<u32>,
    /// Tiers below the pool (L2 host slots, L3/L4 fetches, swap preemption); None: off.
    pub tiers: Option<crate::tiers::TierConfig>,
    /// Sliding window (tokens) of *every* attention layer of the model, 0 for none: blocks
    /// wholly behind it are released as sequences grow (exact; see docs/retention.md). A model
    /// with some full-attention layer passes 0.
    pub sliding_window: u32,
    /// Windows (tokens; 0: a full-attention group) of the *extra* KV cache groups of a hybrid
    /// model: every
    /// sequence gets one more block table per entry, released behind that window, while group
    /// 0 (the global layers) uses `sliding_window` (see docs/retention.md). Empty: one group.
    /// Needs the prefix cache off and no tiers.
    pub group_windows: Vec<u32>,
}

impl SchedulerConfig {
    /// A configuration with vLLM-like defaults: budget 8192, 256 sequences, length 8192, radix
    /// prefix cache, FCFS, no prefill cap, 1% watermark, no EOS.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        SchedulerConfig {
            num_blocks,
            block_size,
            prefix_mode: PrefixMode::Radix,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            max_model_len: 8192,
            policy: Policy::Fcfs,
            long_prefill_token_threshold: 0,
            enable_chunked_prefill: true,
            watermark: 0.01,
            eos_token_id: None,
            tiers: None,
            sliding_window: 0,
            group_windows: Vec::new(),
        }
    }

    /// Refuses zero sizes, a watermark outside `[0, 1)`, and without chunked prefill a budget
    /// smaller than `max_model_len` or a prefill cap.
    pub fn validate(&self) -> KvResult<()> {
        let bad = |m: &str| Err(KvError::InvalidArgument(m.to_string()));
        if self.block_size == 0 {
            return bad("block_size must be at least 1");
        }
        if self.num_blocks < 2 {
            return bad("num_blocks must be at least 2 (block 0 is the null block)");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.max_model_len < 2 {
            return bad("max_model_len must be at least 2 (one prompt and one output token)");
        }
        if !self.enable_chunked_prefill {
            if self.max_num_batched_tokens < self.max_model_len {
                return Err(KvError::InvalidArgument(format!(
                    "without chunked prefill a prompt is computed in one step, so \
                     max_num_batched_tokens ({}) must be at least max_model_len ({}): raise \
                     the budget, lower max_model_len or enable chunked prefill",
                    self.max_num_batched_tokens, self.max_model_len
                )));
            }
            if self.long_prefill_token_threshold > 0 {
                return bad(
                    "long_prefill_token_threshold caps prefill chunks: it needs chunked prefill",
                );
            }
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return bad("watermark must be in [0, 1)");
        }
        if self.watermark_blocks() >= self.num_blocks - 1 {
            return bad("watermark leaves no block to allocate");
        }
        if !self.group_windows.is_empty() {
            if self.group_windows.len() > MAX_GROUPS - 1 {
                return bad("group_windows: at most 15 extra groups");
            }
            if self.prefix_mode != PrefixMode::Off || self.tiers.is_some() {
                return bad("KV cache groups need prefix_mode 'off' and no tiers");
            }
        }
        Ok(())
    }

    /// The watermark as a block count (rounded up).
    pub fn watermark_blocks(&self) -> u32 {
        (self.watermark * f64::from(self.num_blocks)).ceil() as u32
    }

    /// Number of KV cache groups (block tables per sequence).
    pub fn num_groups(&self) -> usize {
        1 + self.group_windows.len()
    }

    /// Blocks holding `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_do_not() {
        let c = SchedulerConfig::new(100, 16);
        assert!(c.validate().is_ok());
        assert_eq!(c.watermark_blocks(), 1);
        assert_eq!(c.blocks_for(17), 2);
        let cases: [fn(&mut SchedulerConfig); 9] = [
            |c| c.block_size = 0,
            |c| c.num_blocks = 1,
            |c| c.max_num_batched_tokens = 0,
            |c| c.max_num_seqs = 0,
            |c| c.max_model_len = 1,
            |c| c.watermark = 1.0,
            |c| c.watermark = -0.1,
            |c| c.watermark = f64::NAN,
            |c| c.watermark = 0.99,
        ];
        for f in cases {
            let mut c = SchedulerConfig::new(100, 16);
            f(&mut c);
            assert!(
                matches!(c.validate(), Err(KvError::InvalidArgument(_))),
                "{c:?}"
            );
        }
    }
}
