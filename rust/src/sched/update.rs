//! `update()`: apply the sampled tokens of the outstanding step and retire finished samples.
//!
//! `sampled[k]` belongs to sample `k` of the plan (`logits_indices[k]`). For each row in plan
//! order: its in-flight tokens become computed (full blocks go to the prefix cache as soon as
//! they are complete); a sampling row appends its token and checks the stop rules; a parent
//! whose prompt just completed forks into its `n` samples first. Rows of sequences aborted
//! since `schedule()` are skipped with their samples.
//!
//! Validation happens before any mutation: a wrong step id or a wrong number of tokens changes
//! nothing. Cost: O(rows) plus O(running) to drop finished sequences from the running list.

use super::{finished, Scheduler};
use crate::error::{KvError, KvResult};
use crate::request::{FinishReason, FinishedSeq, Seq};

impl Scheduler {
    /// Applies the tokens sampled for step `step_id` and returns the samples that finished.
    ///
    /// `Err(NoStepOutstanding | StaleStep)` for a step that is not the outstanding one,
    /// `Err(InvalidArgument)` when `sampled.len()` is not the plan's `num_sampled`.
    pub fn update(&mut self, step_id: u64, sampled: &[u32]) -> KvResult<Vec<FinishedSeq>> {
        self.update_with_drops(step_id, sampled, &[])
    }

    /// `update`, then releases the blocks a caller-side policy (H2O) drops: `drops` are
    /// `(plan row, logical block)` pairs; each must be a full block of the row's sequence that
    /// this step did not write (below `seq_len / block_size`, and below the first block of the
    /// row's query), else `Err(InvalidArgument)` and nothing changes. The drop is lossy (no more
    /// publishing) and applies to every KV cache group; rows that finished or were aborted are
    /// skipped.
    pub fn update_with_drops(
        &mut self,
        step_id: u64,
        sampled: &[u32],
        drops: &[(usize, usize)],
    ) -> KvResult<Vec<FinishedSeq>> {
        if let Some(o) = self.outstanding.as_ref().filter(|o| o.step_id == step_id) {
            let bs = self.cfg.block_size as usize;
            for &(row, block) in drops {
                let ok = o.rows.get(row).is_some_and(|&(idx, kv_id, _)| {
                    self.seqs[idx].as_ref().is_none_or(|s| {
                        s.kv_id != kv_id || block < (s.num_computed - s.num_inflight) / bs
                    })
                });
                if !ok {
                    return Err(KvError::InvalidArgument(format!(
                        "drop (row {row}, block {block}): not a full block computed before step \
                         {step_id}"
                    )));
                }
            }
        }
        let targets: Vec<(usize, u64, usize)> = match &self.outstanding {
            Some(o) if o.step_id == step_id => drops
                .iter()
                .map(|&(row, block)| (o.rows[row].0, o.rows[row].1, block))
                .collect(),
            _ => Vec::new(),
        };
        let out = self.apply_update(step_id, sampled)?;
        let mut n = 0;
        for (idx, kv_id, block) in targets {
            match &self.seqs[idx] {
                Some(s) if s.kv_id == kv_id => {}
                _ => continue, // finished or aborted
            }
            for g in 0..self.cfg.num_groups() {
                n +=
                    self.kv
                        .release_blocks(super::group_kv_id(kv_id, g), block, block + 1, true)?;
            }
        }
        self.num_released_blocks += n as u64;
        Ok(out)
    }

    fn apply_update(&mut self, step_id: u64, sampled: &[u32]) -> KvResult<Vec<FinishedSeq>> {
        match &self.outstanding {
            None => return Err(KvError::NoStepOutstanding { got: step_id }),
            Some(o) if o.step_id != step_id => {
                return Err(KvError::StaleStep {
                    expected: o.step_id,
                    got: step_id,
                })
            }
            Some(o) if o.num_samples != sampled.len() => {
                return Err(KvError::InvalidArgument(format!(
                    "step {step_id} sampled {} tokens, expected {}",
                    sampled.len(),
                    o.num_samples
                )))
            }
            Some(_) => {}
        }
        let o = self.outstanding.take().expect("checked above");
        let (eos, max_len) = (self.cfg.eos_token_id, self.cfg.max_model_len as usize);
        let mut out = Vec::new();
        // Slots freed and sequences forked in this loop are applied after it, so that a reused
        // slab slot never aliases a stale running entry.
        let mut freed = Vec::new();
        let mut forked = Vec::new();
        let mut cursor = 0;
        for &(idx, kv_id, n_samples) in &o.rows {
            let toks = &sampled[cursor..cursor + n_samples as usize];
            cursor += n_samples as usize;
            match &self.seqs[idx] {
                Some(s) if s.kv_id == kv_id => {}
                _ => continue, // aborted after schedule()
            }
            self.seq_mut(idx).num_inflight = 0;
            self.cache_full_blocks(idx)?;
            if toks.len() > 1 {
                self.fork(idx, &toks[1..], &mut forked, &mut out)?;
            }
            if let Some(&tok) = toks.first() {
                let seq = self.seq_mut(idx);
                seq.pending_fork = 1;
                seq.tokens.push(tok);
                if let Some(reason) = seq.finish_reason(tok, eos, max_len) {
                    self.retire(idx, reason, &mut out)?;
                    freed.push(idx);
                }
            }
        }
        if !freed.is_empty() {
            let seqs = &self.seqs;
            self.running.retain(|&i| seqs[i].is_some());
            self.free_slots.extend_from_slice(&freed);
        }
        for idx in forked {
            self.insert_running(idx);
        }
        self.num_finished += out.len() as u64;
        Ok(out)
    }

    /// Hands newly completed full blocks of a running sequence to the prefix cache.
    fn cache_full_blocks(&mut self, idx: usize) -> KvResult<()> {
        let bs = self.cfg.block_size as usize;
        if self.cfg.prefix_mode == crate::prefix::PrefixMode::Off {
            return Ok(());
        }
        let seq = self.seqs[idx].as_mut().expect("live");
        let full = seq.num_computed / bs;
        if full > seq.num_cached_blocks {
            seq.num_cached_blocks = full;
            self.kv
                .cache_computed(seq.kv_id, &seq.tokens[..full * bs])?;
        }
        Ok(())
    }

    /// Forks samples `1..` of a parent whose prompt completed (`toks[k-1]` is sample `k`'s first
    /// token). A sample that finishes on its first token is reported without being created; the
    /// slab indices of created ones are pushed to `forked` (the caller inserts them in running).
    fn fork(
        &mut self,
        parent: usize,
        toks: &[u32],
        forked: &mut Vec<usize>,
        out: &mut Vec<FinishedSeq>,
    ) -> KvResult<()> {
        let (eos, max_len) = (self.cfg.eos_token_id, self.cfg.max_model_len as usize);
        for (k, &tok) in toks.iter().enumerate() {
            let mut child: Seq = self.seq(parent).clone();
            child.kv_id = self.alloc_kv_id();
            child.key.kv_id = child.kv_id;
            child.seq_index = k as u32 + 1;
            child.pending_fork = 1;
            child.tokens.push(tok);
            let req_id = child.req_id;
            let entry = self.requests.get_mut(&req_id).expect("live request");
            if let Some(reason) = child.finish_reason(tok, eos, max_len) {
                entry.num_unfinished -= 1;
                let done = entry.num_unfinished == 0;
                out.push(finished(&child, reason, done));
                // The parent stays live, so the request cannot be done here.
                debug_assert!(!done);
                continue;
            }
            for g in 0..self.cfg.num_groups() {
                let p = super::group_kv_id(self.seq(parent).kv_id, g);
                self.kv.fork(p, super::group_kv_id(child.kv_id, g))?;
            }
            let idx = self.alloc_slot(child);
            self.requests
                .get_mut(&req_id)
                .expect("live request")
                .seqs
                .push(idx);
            forked.push(idx);
        }
        // The parent reserved n slots; it keeps one, each created child keeps one, and the
        // samples that finished at once give theirs back.
        let parent_seq = self.seq_mut(parent);
        parent_seq.pending_fork = 1;
        let live = self.requests[&self.seq(parent).req_id].seqs.len();
        self.running_slots -= toks.len() + 1 - live;
        Ok(())
    }

    /// Removes a finished running sequence: frees its blocks and reports it. The caller returns
    /// the slab slot `idx` to the free list and drops it from `running`.
    fn retire(
        &mut self,
        idx: usize,
        reason: FinishReason,
        out: &mut Vec<FinishedSeq>,
    ) -> KvResult<()> {
        let seq = self.seqs[idx].take().expect("live");
        self.kv.tier_forget(seq.kv_id);
        self.kv.free(
            seq.kv_id,
            self.cache_tokens(&seq.tokens[..seq.num_computed]),
        )?;
        self.free_groups(seq.kv_id)?;
        self.running_slots -= seq.slots();
        let entry = self.requests.get_mut(&seq.req_id).expect("live request");
        entry.seqs.retain(|&i| i != idx);
        entry.num_unfinished -= 1;
        let done = entry.num_unfinished == 0;
        if done {
            self.requests.remove(&seq.req_id);
        }
        out.push(finished(&seq, reason, done));
        Ok(())
    }
}
