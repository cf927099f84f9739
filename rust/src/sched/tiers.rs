//! The scheduler's tier calls from Python: completed fetches, cost measurements, counters.
//!
//! Fetches are reported in one batch per step (`tier_fetched`), before `schedule()`: each
//! sequence's first `count` fetched blocks get L2 slots (returned in order, `u32::MAX` for a
//! block L2 already holds) that the caller fills before the next step loads them.

use super::Scheduler;
use crate::error::{KvError, KvResult};
use crate::tiers::TierStats;

impl Scheduler {
    /// Reports finished fetches: `counts[i]` leading blocks of sequence `kv_ids[i]` arrived
    /// (0: a miss). Returns per-sequence offsets into the returned L2 slots. Sequences no
    /// longer fetching (aborted) get no slots. Err: arrays of different lengths.
    pub fn tier_fetched(
        &mut self,
        kv_ids: &[u64],
        counts: &[usize],
    ) -> KvResult<(Vec<u32>, Vec<u32>)> {
        if kv_ids.len() != counts.len() {
            return Err(KvError::InvalidArgument(format!(
                "tier_fetched: {} sequences but {} counts",
                kv_ids.len(),
                counts.len()
            )));
        }
        let mut offsets = vec![0u32];
        let mut slots = Vec::new();
        for (&id, &n) in kv_ids.iter().zip(counts) {
            slots.extend(self.kv.tier_fetched(id, n));
            offsets.push(slots.len() as u32);
        }
        Ok((offsets, slots))
    }

    /// Updates the swap cost model: host copy bandwidth and forward seconds per token.
    pub fn set_tier_costs(&mut self, copy_bytes_per_s: f64, seconds_per_token: f64) {
        self.kv.set_tier_costs(copy_bytes_per_s, seconds_per_token);
    }

    /// Tier counters (zeros when tiers are off).
    pub fn tier_stats(&self) -> TierStats {
        self.kv.tier_stats()
    }

    /// Sequences waiting for a fetch.
    pub fn num_fetching(&self) -> usize {
        self.waiting
            .values()
            .filter(|&&i| self.kv.is_fetching(self.seq(i).kv_id))
            .count()
    }
}
