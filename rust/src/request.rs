//! Requests as the caller submits them, and the sequences the scheduler runs for them.
//!
//! A request (user id `req_id`) becomes one *sequence* when it is added. With `n > 1` that
//! sequence (the parent, sample index 0) prefills the prompt once; the step that computes the
//! prompt's last token samples `n` tokens from its logits, and `update` forks the parent into
//! `n` sequences (sample indices `0..n`) that share the prompt's blocks (copy-on-write on the
//! partial last block). Every sequence is reported with its request id and its sample index.
//!
//! Invariants of a live [`Seq`]:
//! - `prompt_len <= tokens.len()`, `num_computed < tokens.len()` between steps (a sequence
//!   always has at least its last token to compute), `num_inflight <= num_computed`;
//! - a waiting sequence has `num_computed == 0` and holds no blocks; a running one holds blocks
//!   covering `num_computed` tokens;
//! - `pending_fork > 1` only before the parent's prompt is fully computed.
//!
//! Costs: a sequence owns its token list (prompt + output); a fork copies the token list once.

use crate::error::{KvError, KvResult};

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` output tokens, or the model's maximum length, reached.
    Length,
    /// A stop token id (or EOS, unless `ignore_eos`) was sampled; it is the last output token.
    Stop,
    /// The caller aborted the request.
    Abort,
}

impl FinishReason {
    /// The name used in outputs: "length", "stop" or "abort".
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// A request as submitted to [`crate::sched::Scheduler::add_requests`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    /// Caller's request id, unique among unfinished requests.
    pub id: u64,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Maximum number of output tokens per sample (at least one).
    pub max_tokens: u32,
    /// Priority under the priority policy: a smaller value is served first (default 0).
    pub priority: i32,
    /// Prefix-cache namespace (cache salt, tenant, adapter); 0 is the default namespace.
    pub namespace: u64,
    /// Number of parallel samples (at least one).
    pub n: u32,
    /// When true the scheduler's EOS token does not stop the request.
    pub ignore_eos: bool,
    /// Token ids that stop a sample (the stop token is kept as its last output token).
    pub stop_token_ids: Vec<u32>,
    /// A lossy retention policy (None: keep every block the model's layers can see).
    pub retention: Option<Retention>,
}

/// A lossy, block-granular retention policy (StreamingLLM's sinks + recent window): keep the
/// first `sink_blocks` blocks and the `window_blocks` full blocks before the block being
/// written; release the rest as the sequence grows. Never a default (see docs/retention.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Leading blocks always kept (attention sinks); 0 for a plain window.
    pub sink_blocks: u32,
    /// Full blocks kept before the block being written (at least 1).
    pub window_blocks: u32,
}

impl NewRequest {
    /// A request with default priority, namespace, `n = 1`, EOS honoured and no stop ids.
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: u32) -> Self {
        NewRequest {
            id,
            prompt,
            max_tokens,
            priority: 0,
            namespace: 0,
            n: 1,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            retention: None,
        }
    }

    /// Checks what does not depend on the scheduler's configuration.
    pub(crate) fn validate(&self) -> KvResult<()> {
        crate::kv_manager::check_id("request id", self.id)?;
        crate::kv_manager::check_id("namespace", self.namespace)?;
        if self.prompt.is_empty() {
            return Err(KvError::InvalidArgument(format!(
                "request {}: empty prompt",
                self.id
            )));
        }
        if self.max_tokens == 0 {
            return Err(KvError::InvalidArgument(format!(
                "request {}: max_tokens must be at least 1",
                self.id
            )));
        }
        if self.retention.is_some_and(|r| r.window_blocks == 0) {
            return Err(KvError::InvalidArgument(format!(
                "request {}: a retention window needs at least 1 block",
                self.id
            )));
        }
        if self.n == 0 {
            return Err(KvError::InvalidArgument(format!(
                "request {}: n must be at least 1",
                self.id
            )));
        }
        Ok(())
    }
}

/// One finished sample of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedSeq {
    /// The caller's request id.
    pub req_id: u64,
    /// Which of the request's `n` samples this is (`0..n`).
    pub seq_index: u32,
    /// Output token ids (the prompt excluded; a stop token included).
    pub output: Vec<u32>,
    /// Why it stopped.
    pub reason: FinishReason,
    /// True when this was the request's last unfinished sample (the request id is free again).
    pub request_done: bool,
    /// Most blocks the sample held at once (its parent's prompt blocks included).
    pub peak_blocks: u32,
}

/// Order of service: smaller keys are more important (scheduled first, preempted last).
///
/// Under FCFS `priority` is 0 for all; `arrival` is the admission order of the request; `kv_id`
/// breaks ties between the samples of one request (a later fork is less important).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SeqKey {
    pub priority: i64,
    pub arrival: u64,
    pub kv_id: u64,
}

/// Whether a sequence is in the waiting queue or in the running list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeqStatus {
    Waiting,
    Running,
}

/// A sequence: one sample of a request, the unit the scheduler runs.
#[derive(Debug, Clone)]
pub(crate) struct Seq {
    /// The id under which the KV manager knows this sequence (unique for the scheduler's life).
    pub kv_id: u64,
    /// The caller's request id.
    pub req_id: u64,
    /// Sample index within the request.
    pub seq_index: u32,
    /// Service order (see [`SeqKey`]).
    pub key: SeqKey,
    /// Prompt then output tokens.
    pub tokens: Vec<u32>,
    /// Number of prompt tokens at the front of `tokens`.
    pub prompt_len: usize,
    /// Tokens whose KV is computed, counting the outstanding step's tokens.
    pub num_computed: usize,
    /// Tokens scheduled in the outstanding step (their KV is being computed).
    pub num_inflight: usize,
    /// Full blocks last handed to the prefix cache (`cache_computed`).
    pub num_cached_blocks: usize,
    /// Samples still to fork from this parent (1 = none).
    pub pending_fork: u32,
    /// Waiting or running.
    pub status: SeqStatus,
    /// Times this sequence was preempted.
    pub num_preemptions: u32,
    /// Copied from the request.
    pub max_tokens: u32,
    /// Copied from the request.
    pub namespace: u64,
    /// Copied from the request.
    pub ignore_eos: bool,
    /// Copied from the request.
    pub stop_token_ids: Vec<u32>,
    /// Copied from the request.
    pub retention: Option<Retention>,
    /// Per KV cache group: (exact release, lossy policy) have handled the blocks below these
    /// logical indices.
    pub cursors: Vec<(usize, usize)>,
    /// Most blocks held at once.
    pub peak_blocks: u32,
}

impl Seq {
    /// Number of output tokens so far.
    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Scheduling slots the sequence takes under `max_num_seqs` (its future forks included).
    pub fn slots(&self) -> usize {
        self.pending_fork.max(1) as usize
    }

    /// The finish reason after `token` was appended, if any (stop ids first, then length).
    pub fn finish_reason(
        &self,
        token: u32,
        eos: Option<u32>,
        max_model_len: usize,
    ) -> Option<FinishReason> {
        if (!self.ignore_eos && eos == Some(token)) || self.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.num_output() >= self.max_tokens as usize
            || self.tokens.len() >= max_model_len
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(prompt: usize, out: &[u32]) -> Seq {
        let mut tokens: Vec<u32> = (0..prompt as u32).collect();
        tokens.extend_from_slice(out);
        Seq {
            kv_id: 1,
            req_id: 7,
            seq_index: 0,
            key: SeqKey {
                priority: 0,
                arrival: 0,
                kv_id: 1,
            },
            tokens,
            prompt_len: prompt,
            num_computed: 0,
            num_inflight: 0,
            num_cached_blocks: 0,
            pending_fork: 1,
            status: SeqStatus::Waiting,
            num_preemptions: 0,
            max_tokens: 3,
            namespace: 0,
            ignore_eos: false,
            stop_token_ids: vec![99],
            retention: None,
            cursors: Vec::new(),
            peak_blocks: 0,
        }
    }

    #[test]
    fn finish_rules() {
        // EOS stops unless ignored; stop ids stop regardless; stop wins over length.
        assert_eq!(
            seq(4, &[5]).finish_reason(5, Some(5), 100),
            Some(FinishReason::Stop)
        );
        let mut s = seq(4, &[5]);
        s.ignore_eos = true;
        assert_eq!(s.finish_reason(5, Some(5), 100), None);
        assert_eq!(s.finish_reason(99, Some(5), 100), Some(FinishReason::Stop));
        assert_eq!(
            seq(4, &[1, 2, 99]).finish_reason(99, None, 100),
            Some(FinishReason::Stop)
        );
        assert_eq!(
            seq(4, &[1, 2, 3]).finish_reason(3, None, 100),
            Some(FinishReason::Length)
        );
        assert_eq!(seq(4, &[1, 2]).finish_reason(2, None, 100), None);
        // The model's maximum length counts prompt + output tokens.
        assert_eq!(
            seq(4, &[1]).finish_reason(1, None, 5),
            Some(FinishReason::Length)
        );
        assert_eq!(seq(4, &[1]).finish_reason(1, None, 6), None);
    }

    #[test]
    fn validation() {
        assert!(NewRequest::new(1, vec![1], 1).validate().is_ok());
        assert!(NewRequest::new(1, vec![], 1).validate().is_err());
        assert!(NewRequest::new(1, vec![1], 0).validate().is_err());
        let mut r = NewRequest::new(1, vec![1], 1);
        r.n = 0;
        assert!(r.validate().is_err());
    }

    #[test]
    fn keys_order_priority_then_arrival_then_fork() {
        let a = SeqKey {
            priority: 0,
            arrival: 5,
            kv_id: 9,
        };
        let b = SeqKey {
            priority: 1,
            arrival: 0,
            kv_id: 1,
        };
        let c = SeqKey {
            priority: 0,
            arrival: 5,
            kv_id: 10,
        };
        assert!(a < b && a < c && c < b);
        assert_eq!(FinishReason::Abort.as_str(), "abort");
    }
}
