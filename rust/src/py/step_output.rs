//! Python result types of the scheduler: `StepPlan`, `StepOutput`, `SchedulerStats`.
//!
//! Each is a frozen object built once from the Rust result: the Rust vectors become NumPy
//! arrays without a copy (`PyArray::from_vec` takes ownership of the buffer), so building a
//! plan costs one allocation per array, whatever the batch size. Shapes and dtypes are
//! documented in `python/kvcore/_kvcore.pyi`.

use numpy::ndarray::{Array2, Array3};
use numpy::prelude::*;
use numpy::{PyArray1, PyArray2, PyArray3};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::error::KvError;
use crate::request::FinishedSeq;
use crate::sched::{SchedulerStats, StepPlan};

fn arr1<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Py<PyArray1<T>> {
    PyArray1::from_vec(py, v).unbind()
}

fn arr2(py: Python<'_>, v: Vec<i32>, rows: usize, cols: usize) -> PyResult<Py<PyArray2<i32>>> {
    let a = Array2::from_shape_vec((rows, cols), v)
        .map_err(|e| KvError::Invariant(format!("array shape: {e}")))?;
    Ok(PyArray2::from_owned_array(py, a).unbind())
}

/// One step's work for the model runner (arrays documented in `_kvcore.pyi`).
#[pyclass(name = "StepPlan", module = "kvcore._kvcore", frozen, get_all)]
pub struct PyStepPlan {
    step_id: u64,
    num_reqs: usize,
    num_tokens: usize,
    num_decode: usize,
    num_prefill: usize,
    num_sampled: usize,
    max_query_len: usize,
    max_seq_len: usize,
    req_ids: Py<PyArray1<i64>>,
    seq_index: Py<PyArray1<i32>>,
    input_ids: Py<PyArray1<i64>>,
    positions: Py<PyArray1<i64>>,
    slot_mapping: Py<PyArray1<i64>>,
    query_start_loc: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    block_table: Py<PyArray2<i32>>,
    group_block_table: Py<PyArray3<i32>>,
    group_slot_mapping: Py<PyArray2<i64>>,
    copy_ops: Py<PyArray2<i32>>,
    tier_offload: Py<PyArray2<i32>>,
    tier_load: Py<PyArray2<i32>>,
    tier_io: Py<super::tiers::PyTierPlan>,
    logits_indices: Py<PyArray1<i64>>,
    sample_rows: Py<PyArray1<i32>>,
    sample_req_ids: Py<PyArray1<i64>>,
    sample_seq_index: Py<PyArray1<i32>>,
}

impl PyStepPlan {
    /// Moves the plan's vectors into NumPy arrays.
    pub(crate) fn new(
        py: Python<'_>,
        p: StepPlan,
        block_size: usize,
        extra_groups: usize,
    ) -> PyResult<Self> {
        let (num_reqs, num_ops) = (p.num_reqs(), p.copy_ops.len() / 2);
        let (extra, num_tokens, num_sampled) = (extra_groups, p.num_tokens(), p.num_sampled());
        let shape_err = |e: numpy::ndarray::ShapeError| KvError::Invariant(format!("shape: {e}"));
        let gbt = Array3::from_shape_vec((extra, num_reqs, p.max_blocks), p.group_block_table)
            .map_err(shape_err)?;
        let gsm =
            Array2::from_shape_vec((extra, num_tokens), p.group_slot_mapping).map_err(shape_err)?;
        Ok(PyStepPlan {
            step_id: p.step_id,
            num_reqs,
            num_tokens,
            num_decode: p.num_decode,
            num_prefill: p.num_prefill,
            num_sampled,
            max_query_len: p.max_query_len,
            max_seq_len: p.max_seq_len,
            block_table: arr2(py, p.block_table, num_reqs, p.max_blocks)?,
            group_block_table: PyArray3::from_owned_array(py, gbt).unbind(),
            group_slot_mapping: PyArray2::from_owned_array(py, gsm).unbind(),
            copy_ops: arr2(py, p.copy_ops, num_ops, 2)?,
            tier_offload: super::tiers::pairs(py, &p.tiers.offload)?,
            tier_load: super::tiers::pairs(py, &p.tiers.load)?,
            tier_io: Py::new(py, super::tiers::PyTierPlan::new(py, p.tiers, block_size)?)?,
            req_ids: arr1(py, p.req_ids),
            seq_index: arr1(py, p.seq_index),
            input_ids: arr1(py, p.input_ids),
            positions: arr1(py, p.positions),
            slot_mapping: arr1(py, p.slot_mapping),
            query_start_loc: arr1(py, p.query_start_loc),
            seq_lens: arr1(py, p.seq_lens),
            logits_indices: arr1(py, p.logits_indices),
            sample_rows: arr1(py, p.sample_rows),
            sample_req_ids: arr1(py, p.sample_req_ids),
            sample_seq_index: arr1(py, p.sample_seq_index),
        })
    }
}

#[pymethods]
impl PyStepPlan {
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step_id={}, num_reqs={}, num_tokens={}, num_decode={}, num_prefill={}, \
             num_sampled={})",
            self.step_id,
            self.num_reqs,
            self.num_tokens,
            self.num_decode,
            self.num_prefill,
            self.num_sampled
        )
    }
}

/// Finished samples, as flat arrays (documented in `_kvcore.pyi`).
#[pyclass(name = "StepOutput", module = "kvcore._kvcore", frozen, get_all)]
pub struct PyStepOutput {
    num_finished: usize,
    req_ids: Py<PyArray1<i64>>,
    seq_index: Py<PyArray1<i32>>,
    finish_reasons: Py<PyTuple>,
    request_done: Py<PyArray1<bool>>,
    token_offsets: Py<PyArray1<i64>>,
    token_ids: Py<PyArray1<i64>>,
    peak_blocks: Py<PyArray1<i64>>,
}

impl PyStepOutput {
    /// Flattens finished samples into arrays.
    pub(crate) fn new(py: Python<'_>, fs: Vec<FinishedSeq>) -> PyResult<Self> {
        let n = fs.len();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0i64);
        let mut tokens = Vec::with_capacity(fs.iter().map(|f| f.output.len()).sum());
        for f in &fs {
            tokens.extend(f.output.iter().map(|&t| i64::from(t)));
            offsets.push(tokens.len() as i64);
        }
        Ok(PyStepOutput {
            num_finished: n,
            req_ids: arr1(py, fs.iter().map(|f| f.req_id as i64).collect()),
            seq_index: arr1(py, fs.iter().map(|f| f.seq_index as i32).collect()),
            finish_reasons: PyTuple::new(py, fs.iter().map(|f| f.reason.as_str()))?.unbind(),
            request_done: arr1(py, fs.iter().map(|f| f.request_done).collect()),
            token_offsets: arr1(py, offsets),
            token_ids: arr1(py, tokens),
            peak_blocks: arr1(py, fs.iter().map(|f| i64::from(f.peak_blocks)).collect()),
        })
    }
}

/// `(req_id, seq_index, finish_reason, token_ids)`.
type OutputTuple = (i64, i32, String, Vec<i64>);

#[pymethods]
impl PyStepOutput {
    /// `[(req_id, seq_index, finish_reason, token_ids)]`, one tuple per finished sample.
    /// Reads the arrays, so entries the caller edited in place are checked, never trusted.
    fn outputs(&self, py: Python<'_>) -> PyResult<Vec<OutputTuple>> {
        let bad = || KvError::InvalidArgument("the StepOutput arrays were modified".into());
        let ro = |e: numpy::BorrowError| KvError::InvalidArgument(format!("StepOutput: {e}"));
        let ids = self.req_ids.bind(py).try_readonly().map_err(ro)?;
        let idx = self.seq_index.bind(py).try_readonly().map_err(ro)?;
        let off = self.token_offsets.bind(py).try_readonly().map_err(ro)?;
        let tok = self.token_ids.bind(py).try_readonly().map_err(ro)?;
        let (ids, idx, off, tok) = (
            ids.as_array(),
            idx.as_array(),
            off.as_array(),
            tok.as_array(),
        );
        let reasons = self.finish_reasons.bind(py);
        (0..self.num_finished)
            .map(|i| {
                let span = (off.get(i), off.get(i + 1));
                let (Some(&a), Some(&b)) = span else {
                    return Err(bad().into());
                };
                let (a, b) = (usize::try_from(a), usize::try_from(b));
                let (Ok(a), Ok(b)) = (a, b) else {
                    return Err(bad().into());
                };
                if a > b || b > tok.len() {
                    return Err(bad().into());
                }
                let toks = (a..b).map(|t| tok[t]).collect();
                let (Some(&id), Some(&ix)) = (ids.get(i), idx.get(i)) else {
                    return Err(bad().into());
                };
                Ok((id, ix, reasons.get_item(i)?.extract::<String>()?, toks))
            })
            .collect()
    }

    fn __len__(&self) -> usize {
        self.num_finished
    }

    fn __repr__(&self) -> String {
        format!("StepOutput(num_finished={})", self.num_finished)
    }
}

/// Scheduler counters (documented in `_kvcore.pyi`).
#[pyclass(name = "SchedulerStats", module = "kvcore._kvcore", frozen, get_all)]
pub struct PySchedulerStats {
    num_running: usize,
    num_waiting: usize,
    num_requests: usize,
    kv_usage: f64,
    num_free_blocks: u32,
    prefix_queries: u64,
    prefix_query_tokens: u64,
    prefix_hit_tokens: u64,
    num_preemptions: u64,
    num_scheduled_tokens: usize,
    num_computed_tokens: usize,
    num_steps: u64,
    num_finished: u64,
    num_released_blocks: u64,
    peak_seq_blocks: u32,
}

impl From<SchedulerStats> for PySchedulerStats {
    fn from(s: SchedulerStats) -> Self {
        PySchedulerStats {
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_requests: s.num_requests,
            kv_usage: s.kv_usage,
            num_free_blocks: s.num_free_blocks,
            prefix_queries: s.prefix_queries,
            prefix_query_tokens: s.prefix_query_tokens,
            prefix_hit_tokens: s.prefix_hit_tokens,
            num_preemptions: s.num_preemptions,
            num_scheduled_tokens: s.num_scheduled_tokens,
            num_computed_tokens: s.num_computed_tokens,
            num_steps: s.num_steps,
            num_finished: s.num_finished,
            num_released_blocks: s.num_released_blocks,
            peak_seq_blocks: s.peak_seq_blocks,
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(num_running={}, num_waiting={}, kv_usage={:.3}, num_preemptions={}, \
             num_scheduled_tokens={})",
            self.num_running,
            self.num_waiting,
            self.kv_usage,
            self.num_preemptions,
            self.num_scheduled_tokens
        )
    }
}
