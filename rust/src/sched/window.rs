//! Retention in the scheduler: which of a running sequence's blocks no later step can read.
//!
//! At the start of every `schedule()`, before any block is allocated, each running sequence
//! (between steps it has `c = num_computed` tokens, none in flight; its next query position is
//! `c`) releases:
//!
//! | rule                    | released logical blocks `i`                 | exact? |
//! |-------------------------|---------------------------------------------|--------|
//! | model window `W`        | `(i + 1) * bs <= c + 1 - W` (every layer)    | yes    |
//! | `sink S + window K`     | `S <= i < c / bs - K` (blocks of the policy)| lossy  |
//!
//! A query at position `q >= c` of a layer with window `W` sees keys `k` with `q - k < W`, so
//! a block whose last key is below `c + 1 - W` is dead for every later step. The lossy rule
//! keeps the `S` sink blocks and `K` full blocks before the block being written (the block of
//! position `c`); a prefill chunk attends over all of its own blocks, so retention is
//! block-granular and applies between steps. Two cursors (one per rule) make the cost
//! O(newly released) per sequence per step. Peaks (blocks held at once) are recorded after
//! every allocation.

use super::Scheduler;
use crate::error::KvResult;

impl Scheduler {
    /// Releases, for every running sequence, the blocks no later step can read.
    pub(super) fn release_behind_windows(&mut self) -> KvResult<()> {
        let bs = self.cfg.block_size as usize;
        let w = self.cfg.sliding_window as usize;
        for k in 0..self.running.len() {
            let idx = self.running[k];
            let seq = self.seq(idx);
            if w == 0 && seq.retention.is_none() {
                continue;
            }
            let (c, kv_id, retention) = (seq.num_computed, seq.kv_id, seq.retention);
            let exact_hi = if w > 0 && c + 1 >= w {
                (c + 1 - w) / bs
            } else {
                0
            };
            let mut n = 0;
            let mut cursors = (seq.exact_cursor, seq.lossy_cursor);
            if exact_hi > cursors.0 {
                n += self.kv.release_blocks(kv_id, cursors.0, exact_hi, false)?;
                cursors.0 = exact_hi;
            }
            if let Some(r) = retention {
                let lo = cursors.1.max(r.sink_blocks as usize);
                let hi = (c / bs).saturating_sub(r.window_blocks as usize);
                if hi > lo {
                    n += self.kv.release_blocks(kv_id, lo, hi, true)?;
                    cursors.1 = hi;
                }
            }
            let seq = self.seq_mut(idx);
            (seq.exact_cursor, seq.lossy_cursor) = cursors;
            self.num_released_blocks += n as u64;
        }
        Ok(())
    }

    /// Records the blocks sequence `idx` holds now in its peak and the scheduler's.
    pub(super) fn note_peak(&mut self, idx: usize) -> KvResult<()> {
        let held = self.kv.num_held_blocks(self.seq(idx).kv_id)? as u32;
        let seq = self.seq_mut(idx);
        seq.peak_blocks = seq.peak_blocks.max(held);
        self.peak_seq_blocks = self.peak_seq_blocks.max(held);
        Ok(())
    }
}
