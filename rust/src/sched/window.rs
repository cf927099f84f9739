//! Retention in the scheduler: which of a running sequence's blocks no later step can read, and
//! the KV cache groups of hybrid models.
//!
//! At the start of every `schedule()`, before any block is allocated, each running sequence
//! (between steps it has `c = num_computed` tokens, none in flight; its next query position is
//! `c`) releases, in each of its groups' tables:
//!
//! | rule                    | released logical blocks `i`                 | exact? |
//! |-------------------------|---------------------------------------------|--------|
//! | group window `W`        | `(i + 1) * bs <= c + 1 - W`                  | yes    |
//! | `sink S + window K`     | `S <= i < c / bs - K` (blocks of the policy)| lossy  |
//!
//! A query at position `q >= c` of a layer with window `W` sees keys `k` with `q - k < W`, so
//! a block whose last key is below `c + 1 - W` is dead for every later step. The lossy rule
//! keeps the `S` sink blocks and `K` full blocks before the block being written (the block of
//! position `c`); a prefill chunk attends over all of its own blocks, so retention is
//! block-granular and applies between steps. Two cursors per group make the cost
//! O(newly released) per sequence per step. Peaks (blocks held at once, all groups) are
//! recorded after every allocation.
//!
//! Groups: group 0 is the sequence's own KV id (window `sliding_window`, 0 for global layers);
//! group `g > 0` is the table `group_kv_id(kv_id, g)` in the same KV manager (one pool), window
//! `group_windows[g - 1]`. Every group covers the same tokens; allocation is per group and
//! idempotent, so a partial success followed by a preemption and a retry is safe.

use super::{group_kv_id, Scheduler};
use crate::error::KvResult;
use crate::kv_manager::PrefixHit;

impl Scheduler {
    /// The window of group `g` (0: none).
    fn group_window(&self, g: usize) -> usize {
        if g == 0 {
            self.cfg.sliding_window as usize
        } else {
            self.cfg.group_windows[g - 1] as usize
        }
    }

    /// Releases, for every running sequence, the blocks no later step can read.
    pub(super) fn release_behind_windows(&mut self) -> KvResult<()> {
        let bs = self.cfg.block_size as usize;
        let windowed = (0..self.cfg.num_groups()).any(|g| self.group_window(g) > 0);
        for k in 0..self.running.len() {
            let idx = self.running[k];
            let seq = self.seq(idx);
            if !windowed && seq.retention.is_none() {
                continue;
            }
            let (c, kv_id, retention) = (seq.num_computed, seq.kv_id, seq.retention);
            let mut cursors = seq.cursors.clone();
            let mut n = 0;
            for (g, cur) in cursors.iter_mut().enumerate() {
                let id = group_kv_id(kv_id, g);
                let w = self.group_window(g);
                let exact_hi = if w > 0 && c + 1 >= w {
                    (c + 1 - w) / bs
                } else {
                    0
                };
                if exact_hi > cur.0 {
                    n += self.kv.release_blocks(id, cur.0, exact_hi, false)?;
                    cur.0 = exact_hi;
                }
                if let Some(r) = retention {
                    let lo = cur.1.max(r.sink_blocks as usize);
                    let hi = (c / bs).saturating_sub(r.window_blocks as usize);
                    if hi > lo {
                        n += self.kv.release_blocks(id, lo, hi, true)?;
                        cur.1 = hi;
                    }
                }
            }
            self.seq_mut(idx).cursors = cursors;
            self.num_released_blocks += n as u64;
        }
        Ok(())
    }

    /// Records the blocks sequence `idx` holds now (all groups) in its peak and the scheduler's.
    pub(super) fn note_peak(&mut self, idx: usize) -> KvResult<()> {
        let kv_id = self.seq(idx).kv_id;
        let mut held = 0;
        for g in 0..self.cfg.num_groups() {
            held += self.kv.num_held_blocks(group_kv_id(kv_id, g))? as u32;
        }
        let seq = self.seq_mut(idx);
        seq.peak_blocks = seq.peak_blocks.max(held);
        self.peak_seq_blocks = self.peak_seq_blocks.max(held);
        Ok(())
    }

    /// `allocate_slots` in every group; false when one is short of blocks (the groups that
    /// succeeded keep their blocks: a retry after a preemption allocates only what is missing).
    pub(super) fn allocate_groups(&mut self, kv_id: u64, total: usize) -> KvResult<bool> {
        for g in 0..self.cfg.num_groups() {
            if !self.kv.allocate_slots(group_kv_id(kv_id, g), total)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Admits the extra groups of sequence `idx` (group 0 is admitted) for its first
    /// `num_new` tokens (no prefix hit: groups run without the prefix cache). On a shortage
    /// frees the extra groups it admitted and returns false.
    pub(super) fn admit_groups(&mut self, idx: usize, num_new: usize) -> KvResult<bool> {
        let seq = self.seqs[idx].as_ref().expect("waiting sequence is live");
        let (kv_id, ns) = (seq.kv_id, seq.namespace);
        for g in 1..self.cfg.num_groups() {
            let seq = self.seqs[idx].as_ref().expect("waiting sequence is live");
            let hit = PrefixHit::default();
            let id = group_kv_id(kv_id, g);
            if !self.kv.admit(id, ns, &seq.tokens, &hit, num_new, 0)? {
                for h in 1..g {
                    self.kv.free(group_kv_id(kv_id, h), &[])?;
                }
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Frees the extra groups' tables of `kv_id` (group 0 is freed by the caller).
    pub(super) fn free_groups(&mut self, kv_id: u64) -> KvResult<()> {
        for g in 1..self.cfg.num_groups() {
            self.kv.free(group_kv_id(kv_id, g), &[])?;
        }
        Ok(())
    }
}
