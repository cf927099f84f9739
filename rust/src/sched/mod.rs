//! The continuous-batching scheduler: which sequences run each step and how many tokens each
//! computes.
//!
//! One rule (as in vLLM's v1 scheduler): every sequence has `num_computed` tokens that catch up
//! with its token count within a per-step budget. Prefill, chunked prefill, decode, prefix hits
//! and recompute after preemption are all that rule. A step ([`Scheduler::schedule`]):
//!
//! 1. decodes first: each running sequence one token behind gets it, in service order;
//! 2. then running sequences still prefilling get a chunk (capped by the budget and by
//!    `long_prefill_token_threshold`);
//! 3. then, unless step 1 or 2 preempted someone, waiting sequences are admitted in service
//!    order: the prefix cache is asked first (hit tokens count as computed), and the head is
//!    admitted only if its first chunk fits with the watermark kept free (head-of-line blocking).
//!
//! When a running sequence cannot get a block, the least important running sequence (largest
//! [`SeqKey`]: lowest priority, then latest arrival) is preempted: its blocks are freed (full
//! ones stay in the prefix cache), `num_computed` drops to 0 and it waits again, with its output
//! tokens kept, so recomputing them reproduces the unpreempted run.
//!
//! Invariants (checked by [`Scheduler::check_invariants`]): every live sequence is in exactly one
//! of `waiting` / `running`; `running` is sorted by key; the slots of running sequences are at
//! most `max_num_seqs`; waiting sequences hold no blocks; running ones hold blocks covering their
//! computed tokens; between steps no sequence has tokens in flight.
//!
//! Costs per step: O(running + scheduled tokens + block-table entries), plus O(log waiting) per
//! admission. Nothing per step allocates per sequence except the output arrays.

mod config;
mod invariants;
#[cfg(test)]
mod proptests;
mod snapshot;
mod step;
#[cfg(test)]
mod tests;
mod tiers;
mod update;
mod window;
#[cfg(test)]
mod window_tests;

use std::collections::{BTreeMap, HashMap};

pub use config::{group_kv_id, Policy, SchedulerConfig, MAX_GROUPS};
pub use step::StepPlan;

use crate::error::{KvError, KvResult};
use crate::kv_manager::{KvManager, KvManagerConfig};
use crate::prefix::PrefixMode;
use crate::request::{FinishReason, FinishedSeq, NewRequest, Seq, SeqKey, SeqStatus};

/// Counters readable at any time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// Running sequences.
    pub num_running: usize,
    /// Waiting sequences (new and preempted).
    pub num_waiting: usize,
    /// Unfinished requests.
    pub num_requests: usize,
    /// Fraction of non-null blocks referenced.
    pub kv_usage: f64,
    /// Blocks allocatable now (free plus evictable cached).
    pub num_free_blocks: u32,
    /// Prefix-cache lookups, one per admission (a blocked head's retries are not counted).
    pub prefix_queries: u64,
    /// Tokens looked up in the prefix cache.
    pub prefix_query_tokens: u64,
    /// Of those, tokens found cached.
    pub prefix_hit_tokens: u64,
    /// Preemptions since start.
    pub num_preemptions: u64,
    /// Tokens scheduled by the last `schedule()`.
    pub num_scheduled_tokens: usize,
    /// Sum of computed tokens over running sequences.
    pub num_computed_tokens: usize,
    /// Steps scheduled since start.
    pub num_steps: u64,
    /// Samples finished since start (aborted ones included).
    pub num_finished: u64,
    /// Blocks released by retention (sliding windows, lossy policies) since start.
    pub num_released_blocks: u64,
    /// Most blocks any one sequence held at once since start.
    pub peak_seq_blocks: u32,
}

/// Per-request bookkeeping touched only on add, fork, finish and abort.
#[derive(Debug, Clone)]
struct ReqEntry {
    /// Slab indices of the request's live sequences.
    seqs: Vec<usize>,
    /// Samples not yet finished (live sequences plus pending forks).
    num_unfinished: u32,
}

/// What `update` needs from the outstanding step: each scheduled row, in plan order.
#[derive(Debug, Clone)]
struct Outstanding {
    step_id: u64,
    /// (slab index, kv id, samples taken from the row: 0, 1 or a parent's n).
    rows: Vec<(usize, u64, u32)>,
    num_samples: usize,
}

/// The scheduler: owns the requests, their tokens and the KV manager.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvManager,
    watermark_blocks: u32,
    /// Sequence slab; `free_slots` lists the empty entries.
    seqs: Vec<Option<Seq>>,
    free_slots: Vec<usize>,
    requests: HashMap<u64, ReqEntry>,
    waiting: BTreeMap<SeqKey, usize>,
    /// Slab indices, sorted by key (most important first).
    running: Vec<usize>,
    /// Sum of `Seq::slots` over `running`.
    running_slots: usize,
    next_kv_id: u64,
    next_arrival: u64,
    next_step_id: u64,
    outstanding: Option<Outstanding>,
    num_preemptions: u64,
    num_finished: u64,
    num_scheduled_tokens: usize,
    num_released_blocks: u64,
    peak_seq_blocks: u32,
    /// Scratch buffers reused by `schedule` and `update`.
    scratch_tokens: Vec<usize>,
    scratch_copy: Vec<[u32; 2]>,
}

impl Scheduler {
    /// A scheduler over a fresh KV manager; `Err(InvalidArgument)` for a bad configuration.
    pub fn new(cfg: SchedulerConfig) -> KvResult<Self> {
        cfg.validate()?;
        let mut kv = KvManager::new(KvManagerConfig {
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            prefix_mode: cfg.prefix_mode,
        })?;
        if let Some(t) = &cfg.tiers {
            kv.enable_tiers(t.clone());
        }
        Ok(Scheduler {
            watermark_blocks: cfg.watermark_blocks(),
            cfg,
            kv,
            seqs: Vec::new(),
            free_slots: Vec::new(),
            requests: HashMap::new(),
            waiting: BTreeMap::new(),
            running: Vec::new(),
            running_slots: 0,
            next_kv_id: 1,
            next_arrival: 0,
            next_step_id: 1,
            outstanding: None,
            num_preemptions: 0,
            num_finished: 0,
            num_scheduled_tokens: 0,
            num_released_blocks: 0,
            peak_seq_blocks: 0,
            scratch_tokens: Vec::new(),
            scratch_copy: Vec::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The KV manager (read-only: block tables, cache stats, invariants).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// The KV manager, mutable (tests).
    #[cfg(test)]
    pub(crate) fn kv_mut(&mut self) -> &mut KvManager {
        &mut self.kv
    }

    /// True while some request is unfinished.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// The step id awaiting `update`, if any.
    pub fn outstanding_step(&self) -> Option<u64> {
        self.outstanding.as_ref().map(|o| o.step_id)
    }

    /// Adds a batch of requests to the waiting queue, in order (all or nothing).
    ///
    /// Refused: a duplicate id (in the batch or unfinished), an empty prompt, `max_tokens` or
    /// `n` of 0, `n > max_num_seqs`, a prompt that leaves no room for one output token within
    /// `max_model_len` (`TooLong`), or a sequence whose longest possible run, plus one spare
    /// block, cannot fit in the pool beside the watermark (`TooLong`: it could never finish).
    pub fn add_requests(&mut self, reqs: Vec<NewRequest>) -> KvResult<()> {
        let mut seen = std::collections::HashSet::with_capacity(reqs.len());
        for r in &reqs {
            r.validate()?;
            if self.requests.contains_key(&r.id) || !seen.insert(r.id) {
                return Err(KvError::DuplicateRequest(r.id));
            }
            self.check_fits(r)?;
        }
        for r in reqs {
            self.insert_request(r);
        }
        Ok(())
    }

    fn check_fits(&self, r: &NewRequest) -> KvResult<()> {
        let max_len = self.cfg.max_model_len as usize;
        if r.n > self.cfg.max_num_seqs {
            return Err(KvError::InvalidArgument(format!(
                "request {}: n = {} exceeds max_num_seqs = {}",
                r.id, r.n, self.cfg.max_num_seqs
            )));
        }
        if r.prompt.len() >= max_len {
            return Err(KvError::TooLong(format!(
                "request {}: prompt of {} tokens leaves no room for output (max_model_len {})",
                r.id,
                r.prompt.len(),
                max_len
            )));
        }
        // The last token of a run is sampled, never computed: KV is needed for len - 1 tokens.
        // Alone in the pool a sequence must always be admissible, so that it cannot wait
        // forever: its blocks, the watermark, and one spare block for the source of a
        // copy-on-write when its prefix hit ends inside a block.
        let longest = (r.prompt.len() + r.max_tokens as usize).min(max_len) - 1;
        let usable = (self.cfg.num_blocks - 1 - self.watermark_blocks) as usize;
        if self.cfg.blocks_for(longest) * self.cfg.num_groups() + 1 > usable {
            return Err(KvError::TooLong(format!(
                "request {}: up to {} tokens need {} blocks (+1 spare); the pool has {} beside \
                 the watermark",
                r.id,
                longest,
                self.cfg.blocks_for(longest) * self.cfg.num_groups(),
                usable
            )));
        }
        Ok(())
    }

    fn insert_request(&mut self, r: NewRequest) {
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let kv_id = self.alloc_kv_id();
        let priority = match self.cfg.policy {
            Policy::Fcfs => 0,
            Policy::Priority => i64::from(r.priority),
        };
        let key = SeqKey {
            priority,
            arrival,
            kv_id,
        };
        let seq = Seq {
            kv_id,
            req_id: r.id,
            seq_index: 0,
            key,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            num_computed: 0,
            num_inflight: 0,
            num_cached_blocks: 0,
            pending_fork: r.n,
            status: SeqStatus::Waiting,
            num_preemptions: 0,
            max_tokens: r.max_tokens,
            namespace: r.namespace,
            ignore_eos: r.ignore_eos,
            stop_token_ids: r.stop_token_ids,
            retention: r.retention,
            cursors: vec![(0, 0); self.cfg.num_groups()],
            peak_blocks: 0,
        };
        let idx = self.alloc_slot(seq);
        self.waiting.insert(key, idx);
        self.requests.insert(
            r.id,
            ReqEntry {
                seqs: vec![idx],
                num_unfinished: r.n,
            },
        );
    }

    fn alloc_kv_id(&mut self) -> u64 {
        let id = self.next_kv_id;
        self.next_kv_id += 1;
        id
    }

    fn alloc_slot(&mut self, seq: Seq) -> usize {
        match self.free_slots.pop() {
            Some(i) => {
                self.seqs[i] = Some(seq);
                i
            }
            None => {
                self.seqs.push(Some(seq));
                self.seqs.len() - 1
            }
        }
    }

    fn seq(&self, idx: usize) -> &Seq {
        self.seqs[idx]
            .as_ref()
            .expect("slab index of a live sequence")
    }

    fn seq_mut(&mut self, idx: usize) -> &mut Seq {
        self.seqs[idx]
            .as_mut()
            .expect("slab index of a live sequence")
    }

    /// Aborts a batch of requests (all or nothing: an unknown id refuses the whole batch).
    ///
    /// May be called between `schedule` and `update`: the aborted rows' samples are then
    /// ignored. Returns one entry per unfinished sample, with the output produced so far.
    pub fn abort_requests(&mut self, ids: &[u64]) -> KvResult<Vec<FinishedSeq>> {
        if let Some(&id) = ids.iter().find(|id| !self.requests.contains_key(id)) {
            return Err(KvError::UnknownRequest(id));
        }
        let mut out = Vec::new();
        for &id in ids {
            let Some(entry) = self.requests.remove(&id) else {
                continue;
            }; // repeated id
            let mut removed_running = false;
            let mut remaining = entry.num_unfinished;
            for &idx in &entry.seqs {
                let seq = self.seqs[idx]
                    .take()
                    .expect("request entry lists live sequences");
                self.free_slots.push(idx);
                self.kv.tier_forget(seq.kv_id);
                match seq.status {
                    SeqStatus::Waiting => {
                        self.waiting.remove(&seq.key);
                    }
                    SeqStatus::Running => {
                        // Only KV of finished steps goes to the prefix cache.
                        let done = seq.num_computed - seq.num_inflight;
                        self.kv
                            .free(seq.kv_id, self.cache_tokens(&seq.tokens[..done]))?;
                        self.free_groups(seq.kv_id)?;
                        self.running_slots -= seq.slots();
                        removed_running = true;
                    }
                }
                let pending = seq.pending_fork;
                remaining -= 1;
                out.push(finished(&seq, FinishReason::Abort, false));
                for k in 1..pending {
                    remaining -= 1;
                    out.push(FinishedSeq {
                        req_id: id,
                        seq_index: k,
                        output: Vec::new(),
                        reason: FinishReason::Abort,
                        request_done: false,
                        peak_blocks: seq.peak_blocks,
                    });
                }
            }
            debug_assert_eq!(remaining, 0);
            if let Some(last) = out.last_mut() {
                last.request_done = true;
            }
            if removed_running {
                let seqs = &self.seqs;
                self.running.retain(|&i| seqs[i].is_some());
            }
        }
        self.num_finished += out.len() as u64;
        Ok(out)
    }

    /// The tokens to hand to the prefix cache: none when it is off (saves the hashing).
    fn cache_tokens<'a>(&self, tokens: &'a [u32]) -> &'a [u32] {
        if self.cfg.prefix_mode == PrefixMode::Off {
            &[]
        } else {
            tokens
        }
    }

    /// Counters and gauges (O(running) for the computed-token sum).
    pub fn stats(&self) -> SchedulerStats {
        let cache = self.kv.stats();
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_requests: self.requests.len(),
            kv_usage: self.kv.usage(),
            num_free_blocks: self.kv.num_free_blocks(),
            prefix_queries: cache.queries,
            prefix_query_tokens: cache.query_tokens,
            prefix_hit_tokens: cache.hit_tokens,
            num_preemptions: self.num_preemptions,
            num_scheduled_tokens: self.num_scheduled_tokens,
            num_computed_tokens: self.running.iter().map(|&i| self.seq(i).num_computed).sum(),
            num_steps: self.next_step_id - 1,
            num_finished: self.num_finished,
            num_released_blocks: self.num_released_blocks,
            peak_seq_blocks: self.peak_seq_blocks,
        }
    }
}

/// A finished-sample record for `seq` (output = its tokens after the prompt).
fn finished(seq: &Seq, reason: FinishReason, request_done: bool) -> FinishedSeq {
    FinishedSeq {
        req_id: seq.req_id,
        seq_index: seq.seq_index,
        output: seq.tokens[seq.prompt_len..].to_vec(),
        reason,
        request_done,
        peak_blocks: seq.peak_blocks,
    }
}
