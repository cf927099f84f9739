//! `schedule()`: choose this step's rows and lay them out as flat arrays (the StepPlan).
//!
//! Row order: rows with one query token (decodes) first, then rows with more (prefill chunks);
//! inside each group running sequences in service order, then newly admitted ones. Tokens of
//! row `r` are `input_ids[query_start_loc[r]..query_start_loc[r + 1]]`:
//!
//! ```text
//!  sequence tokens:  [0 .............. num_computed | new (this step) | rest ...]
//!  positions:                           num_computed ... seq_len - 1
//!  seq_lens[r] = num_computed + new     (the context the row attends to, this step included)
//!  sampled iff seq_len == len(tokens)   (a chunk that stops short samples nothing)
//! ```
//!
//! A row's samples are logits row `query_start_loc[r + 1] - 1`, once, or `n` times for a parent
//! whose prompt completes this step (its samples are indices `0..n` of the request).
//! Cost: O(rows + tokens + rows * max_blocks).

use std::ops::Bound::{Excluded, Unbounded};

use super::{Outstanding, Scheduler};
use crate::error::{KvError, KvResult};
use crate::request::{SeqKey, SeqStatus};

/// One step's work as flat arrays, typed as the NumPy arrays they become.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    /// Id to pass back to `update`.
    pub step_id: u64,
    /// [num_reqs] request id of each row.
    pub req_ids: Vec<i64>,
    /// [num_reqs] sample index of each row (a parent before its fork is sample 0).
    pub seq_index: Vec<i32>,
    /// [num_tokens] token ids to compute.
    pub input_ids: Vec<i64>,
    /// [num_tokens] their positions.
    pub positions: Vec<i64>,
    /// [num_tokens] KV slot of each token: `block_id * block_size + position % block_size`.
    pub slot_mapping: Vec<i64>,
    /// [num_reqs + 1] offsets of each row's tokens (cu_seqlens of the queries).
    pub query_start_loc: Vec<i32>,
    /// [num_reqs] context length of each row, this step's tokens included.
    pub seq_lens: Vec<i32>,
    /// [num_reqs * max_blocks] row-major block table, padded with the null block 0.
    pub block_table: Vec<i32>,
    /// Width of `block_table`.
    pub max_blocks: usize,
    /// [num_copy_ops * 2] (src, dst) block pairs to copy before the forward, in order.
    pub copy_ops: Vec<i32>,
    /// [num_sampled] index into the token batch of each sampled logits row.
    pub logits_indices: Vec<i64>,
    /// [num_sampled] plan row of each sample.
    pub sample_rows: Vec<i32>,
    /// [num_sampled] request id of each sample.
    pub sample_req_ids: Vec<i64>,
    /// [num_sampled] sample index (within its request) of each sample.
    pub sample_seq_index: Vec<i32>,
    /// Rows with exactly one query token (they come first).
    pub num_decode: usize,
    /// Rows with more than one query token.
    pub num_prefill: usize,
    /// Longest query of the step.
    pub max_query_len: usize,
    /// Longest `seq_lens` entry.
    pub max_seq_len: usize,
    /// Tier moves to apply before the forward (publish, offload, load) and fetches to start.
    pub tiers: crate::tiers::TierOps,
    /// [(num_groups - 1) * num_reqs * max_blocks] the block tables of the extra KV cache
    /// groups (group-major, then like `block_table`); empty with one group.
    pub group_block_table: Vec<i32>,
    /// [(num_groups - 1) * num_tokens] each token's slot in each extra group's table.
    pub group_slot_mapping: Vec<i64>,
}

impl StepPlan {
    /// Number of rows.
    pub fn num_reqs(&self) -> usize {
        self.req_ids.len()
    }

    /// Number of tokens.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Number of tokens `update` expects.
    pub fn num_sampled(&self) -> usize {
        self.logits_indices.len()
    }
}

impl Scheduler {
    /// Plans the next step. `Err` if the previous step still awaits `update` (nothing changes).
    pub fn schedule(&mut self) -> KvResult<StepPlan> {
        if let Some(o) = &self.outstanding {
            return Err(KvError::InvalidArgument(format!(
                "step {} is outstanding: call update() before schedule()",
                o.step_id
            )));
        }
        self.release_behind_windows()?;
        let mut budget = self.cfg.max_num_batched_tokens as usize;
        let mut sched = std::mem::take(&mut self.scratch_tokens);
        sched.clear();
        sched.resize(self.running.len(), 0);
        let mut preempted = false;
        for decode_pass in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let seq = self.seq(self.running[i]);
                let remaining = seq.tokens.len() - seq.num_computed;
                if sched[i] > 0 || (remaining == 1) != decode_pass {
                    i += 1;
                    continue;
                }
                let num_new = self.chunk(remaining, budget);
                let (kv_id, total) = (seq.kv_id, seq.num_computed + num_new);
                loop {
                    if self.allocate_groups(kv_id, total)? {
                        self.note_peak(self.running[i])?;
                        sched[i] = num_new;
                        budget -= num_new;
                        i += 1;
                        break;
                    }
                    // Short of blocks: preempt the least important running sequence (the tail).
                    // If it was scheduled in the decode pass its budget comes back, and freeing
                    // it cancels a copy op it recorded then (its destination went back).
                    let victim = self
                        .running
                        .pop()
                        .expect("running holds the current sequence");
                    budget += sched.pop().expect("one entry per running sequence");
                    self.preempt(victim)?;
                    preempted = true;
                    if self.running.len() == i {
                        break; // the current sequence was the tail
                    }
                }
            }
        }
        let mut rows: Vec<(usize, usize)> = Vec::with_capacity(self.running.len());
        rows.extend(
            self.running
                .iter()
                .zip(&sched)
                .filter(|(_, &n)| n > 0)
                .map(|(&s, &n)| (s, n)),
        );
        self.scratch_tokens = sched;
        let admitted = if preempted {
            Vec::new()
        } else {
            self.admit_waiting(&mut budget)?
        };
        rows.extend_from_slice(&admitted);
        for &(s, _) in &admitted {
            self.insert_running(s);
        }
        // Decodes first; a stable partition keeps service order inside each group.
        let num_decode = rows.iter().filter(|r| r.1 == 1).count();
        let mut ordered = Vec::with_capacity(rows.len());
        ordered.extend(rows.iter().filter(|r| r.1 == 1));
        ordered.extend(rows.iter().filter(|r| r.1 > 1));
        let plan = self.build_plan(&ordered, num_decode)?;
        self.num_scheduled_tokens = plan.num_tokens();
        Ok(plan)
    }

    /// Tokens a sequence computes this step: what it lacks, within budget and prefill cap.
    /// Without chunked prefill: all it lacks or, when that does not fit, 0 (it waits).
    fn chunk(&self, remaining: usize, budget: usize) -> usize {
        if !self.cfg.enable_chunked_prefill {
            return if remaining <= budget { remaining } else { 0 };
        }
        let mut n = remaining.min(budget);
        let cap = self.cfg.long_prefill_token_threshold as usize;
        if cap > 0 {
            n = n.min(cap);
        }
        n
    }

    /// Frees a running sequence's blocks (full computed ones stay cached) and queues it again.
    fn preempt(&mut self, idx: usize) -> KvResult<()> {
        let seq = self.seqs[idx].as_ref().expect("running sequence is live");
        // Swap preemption (when tiers and the cost model say so) copies the blocks to L2 first.
        self.kv.swap_out(seq.kv_id, seq.num_computed);
        let tokens = self.cache_tokens(&seq.tokens[..seq.num_computed]);
        let kv_id = seq.kv_id;
        self.kv.free(kv_id, tokens)?;
        self.free_groups(kv_id)?;
        let seq = self.seqs[idx].as_mut().expect("running sequence is live");
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        seq.cursors.iter_mut().for_each(|c| *c = (0, 0));
        seq.status = SeqStatus::Waiting;
        seq.num_preemptions += 1;
        let (key, slots) = (seq.key, seq.slots());
        self.running_slots -= slots;
        self.waiting.insert(key, idx);
        self.num_preemptions += 1;
        Ok(())
    }

    /// Admits waiting sequences in key order while budget, `max_num_seqs` and blocks allow.
    fn admit_waiting(&mut self, budget: &mut usize) -> KvResult<Vec<(usize, usize)>> {
        let mut admitted = Vec::new();
        let max_slots = self.cfg.max_num_seqs as usize;
        // Sequences waiting for a tier fetch are passed over (`cursor`), not waited for.
        let mut cursor: Option<SeqKey> = None;
        while *budget > 0 {
            let next = match cursor {
                None => self.waiting.first_key_value(),
                Some(c) => self.waiting.range((Excluded(c), Unbounded)).next(),
            };
            let Some((&key, &idx)) = next else {
                break;
            };
            let seq = self.seqs[idx].as_ref().expect("waiting sequence is live");
            if self.running_slots + seq.slots() > max_slots {
                break;
            }
            // The last token is always computed so that its logits can be sampled. A head
            // that cannot be admitted is looked up again next step: count it once, admitted.
            let hit =
                self.kv
                    .lookup_tiered(seq.kv_id, seq.namespace, &seq.tokens, seq.tokens.len() - 1);
            if self
                .kv
                .want_fetch(seq.kv_id, seq.namespace, &seq.tokens, &hit)
            {
                self.kv.release_hit(&hit);
                cursor = Some(key);
                continue;
            }
            let computed = hit.num_tokens;
            let num_new = self.chunk(seq.tokens.len() - computed, *budget);
            if num_new == 0 {
                self.kv.release_hit(&hit);
                break; // without chunked prefill the head's prompt waits for a roomier step
            }
            if !self.kv.admit_tiered(
                seq.kv_id,
                seq.namespace,
                &seq.tokens,
                &hit,
                num_new,
                self.watermark_blocks,
            )? {
                break;
            }
            let query_len = seq.tokens.len();
            if !self.admit_groups(idx, num_new)? {
                let kv_id = self.seq(idx).kv_id;
                self.kv.free(kv_id, &[])?;
                break;
            }
            self.kv.record_query(query_len, computed);
            self.note_peak(idx)?;
            self.waiting.remove(&key);
            let seq = self.seqs[idx].as_mut().expect("waiting sequence is live");
            seq.num_computed = computed;
            // Blocks loaded from L2 enter the prefix cache after the step that loads them.
            seq.num_cached_blocks = hit.l1.num_tokens / self.cfg.block_size as usize;
            seq.status = SeqStatus::Running;
            self.running_slots += seq.slots();
            *budget -= num_new;
            admitted.push((idx, num_new));
        }
        Ok(admitted)
    }

    /// Inserts a sequence into `running` at its key's place.
    pub(super) fn insert_running(&mut self, idx: usize) {
        let key = self.seq(idx).key;
        let seqs = &self.seqs;
        let pos = self
            .running
            .partition_point(|&i| seqs[i].as_ref().expect("live").key < key);
        self.running.insert(pos, idx);
    }

    /// Lays out `rows` (slab index, new tokens) and records the outstanding step.
    fn build_plan(&mut self, rows: &[(usize, usize)], num_decode: usize) -> KvResult<StepPlan> {
        let bs = self.cfg.block_size as usize;
        let num_tokens: usize = rows.iter().map(|r| r.1).sum();
        let max_blocks = rows
            .iter()
            .map(|&(s, n)| self.cfg.blocks_for(self.seq(s).num_computed + n))
            .max()
            .unwrap_or(0);
        let mut p = StepPlan {
            step_id: self.next_step_id,
            req_ids: Vec::with_capacity(rows.len()),
            seq_index: Vec::with_capacity(rows.len()),
            input_ids: Vec::with_capacity(num_tokens),
            positions: Vec::with_capacity(num_tokens),
            slot_mapping: Vec::with_capacity(num_tokens),
            query_start_loc: Vec::with_capacity(rows.len() + 1),
            seq_lens: Vec::with_capacity(rows.len()),
            block_table: vec![0; rows.len() * max_blocks],
            group_block_table: vec![0; (self.cfg.num_groups() - 1) * rows.len() * max_blocks],
            group_slot_mapping: vec![0; (self.cfg.num_groups() - 1) * num_tokens],
            max_blocks,
            num_decode,
            num_prefill: rows.len() - num_decode,
            ..StepPlan::default()
        };
        let mut out_rows = Vec::with_capacity(rows.len());
        let mut num_samples = 0;
        p.query_start_loc.push(0);
        for (r, &(s, num_new)) in rows.iter().enumerate() {
            let seq = self.seqs[s].as_ref().expect("scheduled sequence is live");
            let (start, end) = (seq.num_computed, seq.num_computed + num_new);
            let table = self.kv.block_table(seq.kv_id)?;
            let nb = end.div_ceil(bs);
            for (dst, &b) in p.block_table[r * max_blocks..r * max_blocks + nb]
                .iter_mut()
                .zip(table)
            {
                *dst = b as i32;
            }
            let q_start = p.input_ids.len();
            for (pos, &tok) in (start..end).zip(&seq.tokens[start..end]) {
                p.input_ids.push(i64::from(tok));
                p.positions.push(pos as i64);
                p.slot_mapping
                    .push(i64::from(table[pos / bs]) * bs as i64 + (pos % bs) as i64);
            }
            for g in 1..self.cfg.num_groups() {
                let table = self.kv.block_table(super::group_kv_id(seq.kv_id, g))?;
                let row = ((g - 1) * rows.len() + r) * max_blocks;
                for (dst, &b) in p.group_block_table[row..row + nb].iter_mut().zip(table) {
                    *dst = b as i32;
                }
                let slots = &mut p.group_slot_mapping[(g - 1) * num_tokens + q_start..];
                for (dst, pos) in slots.iter_mut().zip(start..end) {
                    *dst = i64::from(table[pos / bs]) * bs as i64 + (pos % bs) as i64;
                }
            }
            let q_end = p.input_ids.len();
            p.query_start_loc.push(q_end as i32);
            p.seq_lens.push(end as i32);
            p.req_ids.push(seq.req_id as i64);
            p.seq_index.push(seq.seq_index as i32);
            p.max_query_len = p.max_query_len.max(num_new);
            p.max_seq_len = p.max_seq_len.max(end);
            let n_samples = if end == seq.tokens.len() {
                seq.pending_fork.max(1)
            } else {
                0
            };
            for k in 0..n_samples {
                p.logits_indices.push(q_end as i64 - 1);
                p.sample_rows.push(r as i32);
                p.sample_req_ids.push(seq.req_id as i64);
                let index = if seq.pending_fork > 1 {
                    k
                } else {
                    seq.seq_index
                };
                p.sample_seq_index.push(index as i32);
            }
            num_samples += n_samples as usize;
            out_rows.push((s, seq.kv_id, n_samples));
            let seq = self.seqs[s].as_mut().expect("scheduled sequence is live");
            seq.num_computed = end;
            seq.num_inflight = num_new;
        }
        let mut ops = std::mem::take(&mut self.scratch_copy);
        ops.clear();
        self.kv.drain_copy_ops(&mut ops);
        p.copy_ops = ops
            .iter()
            .flat_map(|op| [op[0] as i32, op[1] as i32])
            .collect();
        self.scratch_copy = ops;
        self.kv.drain_tier_ops(&mut p.tiers);
        self.outstanding = Some(Outstanding {
            step_id: p.step_id,
            rows: out_rows,
            num_samples,
        });
        self.next_step_id += 1;
        Ok(p)
    }
}
