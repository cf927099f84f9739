//! `check_invariants()`: the scheduler's consistency checks, run after every operation in tests.
//!
//! What it verifies: every live sequence sits in exactly one of `waiting` / `running`; the slab's
//! free list matches its empty slots; `running` is sorted by key and its slots are counted right
//! and within `max_num_seqs`; between steps every running sequence has a token left to compute
//! and no token in flight, and its block table covers its computed tokens; waiting sequences
//! hold no blocks; each request's unfinished count equals its live sequences plus pending
//! forks; with no sequence left every block is back in the pool. Then the KV manager's own
//! checks. Cost: O(sequences + blocks).

use super::Scheduler;
use crate::error::{KvError, KvResult};
use crate::request::SeqStatus;

impl Scheduler {
    /// Verifies the scheduler's invariants and the KV manager's; `Err(Invariant)` names the first
    /// violation.
    pub fn check_invariants(&self) -> KvResult<()> {
        let fail = |m: String| Err(KvError::Invariant(m));
        self.kv.check_invariants()?;
        if let Some(t) = self.kv.tiers() {
            t.check_invariants()?;
        }
        let live = self.seqs.iter().filter(|s| s.is_some()).count();
        if live != self.running.len() + self.waiting.len() {
            return fail(format!(
                "{live} live sequences but {} running + {} waiting",
                self.running.len(),
                self.waiting.len()
            ));
        }
        if live + self.free_slots.len() != self.seqs.len() {
            return fail("slab free list does not match empty slots".into());
        }
        let mut slots = 0;
        for (pos, &i) in self.running.iter().enumerate() {
            let Some(s) = &self.seqs[i] else {
                return fail(format!("running slot {i} empty"));
            };
            if s.status != SeqStatus::Running {
                return fail(format!("sequence {} in running but not running", s.kv_id));
            }
            if pos > 0 && self.seq(self.running[pos - 1]).key >= s.key {
                return fail("running list not sorted by key".into());
            }
            if self.outstanding.is_none()
                && (s.num_inflight != 0 || s.num_computed >= s.tokens.len())
            {
                return fail(format!("sequence {} has nothing left to compute", s.kv_id));
            }
            let table = self.kv.block_table(s.kv_id)?;
            if table.len() * (self.cfg.block_size as usize) < s.num_computed {
                return fail(format!(
                    "sequence {}: block table shorter than its tokens",
                    s.kv_id
                ));
            }
            slots += s.slots();
        }
        if slots != self.running_slots || slots > self.cfg.max_num_seqs as usize {
            return fail(format!(
                "running slots {slots} (kept {})",
                self.running_slots
            ));
        }
        for (key, &i) in &self.waiting {
            let Some(s) = &self.seqs[i] else {
                return fail(format!("waiting slot {i} empty"));
            };
            if s.key != *key || s.status != SeqStatus::Waiting || s.num_computed != 0 {
                return fail(format!("waiting sequence {} inconsistent", s.kv_id));
            }
            if self.kv.block_table(s.kv_id).is_ok() {
                return fail(format!("waiting sequence {} holds blocks", s.kv_id));
            }
        }
        let mut listed = 0;
        for (id, e) in &self.requests {
            for &i in &e.seqs {
                match &self.seqs[i] {
                    Some(s) if s.req_id == *id => listed += 1,
                    _ => return fail(format!("request {id} lists a sequence it does not own")),
                }
            }
            let pending: u32 = e.seqs.iter().map(|&i| self.seq(i).pending_fork - 1).sum();
            if e.num_unfinished != e.seqs.len() as u32 + pending {
                return fail(format!("request {id}: unfinished count off"));
            }
        }
        if listed != live {
            return fail("a live sequence belongs to no request".into());
        }
        if live == 0 && self.kv.num_free_blocks() != self.cfg.num_blocks - 1 {
            return fail(format!(
                "no sequence left but only {} of {} blocks free",
                self.kv.num_free_blocks(),
                self.cfg.num_blocks - 1
            ));
        }
        Ok(())
    }
}
