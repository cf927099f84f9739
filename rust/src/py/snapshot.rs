//! `kv_snapshot(scheduler)`: one read-only picture of the scheduler's KV state for the live
//! dashboard, taken under the scheduler's lock in one call (the pool, the prefix cache's
//! flags, every live table and the scheduler's counters agree with each other). Arrays cross
//! as NumPy vectors without a copy (`PyArray1::from_vec`); nothing per block is a Python object.
//! Tables are per sequence (`kv_ids`); `req_ids` names each one's request (the caller's id).

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::scheduler::PyScheduler;
use super::step_output::PySchedulerStats;

/// The kv-id bits below a KV group's tag (`sched::group_kv_id`).
const GROUP_MASK: u64 = (1 << 56) - 1;

/// The scheduler's pool, cache flags, tables and stats at one instant (see `_kvcore.pyi`).
#[pyfunction]
pub(crate) fn kv_snapshot<'py>(
    py: Python<'py>,
    scheduler: &Bound<'py, PyScheduler>,
) -> PyResult<Bound<'py, PyDict>> {
    let (s, owners, stats) = scheduler.get().inner.with(py, |sch| {
        (sch.kv().snapshot(), sch.kv_owners(), sch.stats())
    })?;
    // Tables are keyed by kv id (one per sequence and KV group): name their requests.
    let req_ids: Vec<u64> = s
        .req_ids
        .iter()
        .map(|&kv| {
            let base = kv & GROUP_MASK;
            match owners.binary_search_by_key(&base, |o| o.0) {
                Ok(i) => owners[i].1,
                Err(_) => u64::MAX,
            }
        })
        .collect();
    let d = PyDict::new(py);
    d.set_item("ref_counts", PyArray1::from_vec(py, s.ref_counts))?;
    d.set_item("cached", PyArray1::from_vec(py, s.cached))?;
    d.set_item("kv_ids", PyArray1::from_vec(py, s.req_ids))?;
    d.set_item("req_ids", PyArray1::from_vec(py, req_ids))?;
    d.set_item("namespaces", PyArray1::from_vec(py, s.namespaces))?;
    d.set_item("num_tokens", PyArray1::from_vec(py, s.num_tokens))?;
    d.set_item("num_released", PyArray1::from_vec(py, s.num_released))?;
    d.set_item("offsets", PyArray1::from_vec(py, s.offsets))?;
    d.set_item("blocks", PyArray1::from_vec(py, s.blocks))?;
    d.set_item("num_l2_entries", s.num_l2_entries)?;
    d.set_item("stats", PySchedulerStats::from(stats))?;
    Ok(d)
}
