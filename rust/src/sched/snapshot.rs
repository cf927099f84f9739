//! Which request owns each sequence's KV tables, for the dashboard's one read-only snapshot
//! (`py/snapshot.rs`). A child module of `sched`, so it reads the slab; nothing here mutates.
//! Cost: O(sequences).

use super::Scheduler;

impl Scheduler {
    /// `(kv id, request id)` of every live sequence, sorted by kv id. Tables of other KV
    /// groups are `group_kv_id(kv_id, g)`: mask off the group bits to look them up.
    pub fn kv_owners(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .seqs
            .iter()
            .flatten()
            .map(|s| (s.kv_id, s.req_id))
            .collect();
        v.sort_unstable();
        v
    }
}
