//! Python bindings of the scheduler: `Scheduler`, `StepPlan`, `StepOutput`, `SchedulerStats`.
//!
//! Two boundary crossings per step: `schedule()` returns a `StepPlan` whose arrays are the
//! Rust vectors handed to NumPy without a copy (`PyArray::from_vec`), and `update()` takes the
//! sampled tokens as one NumPy array. Admission and abort are batched (flat arrays + offsets).
//! The heavy Rust work runs with the GIL released. Every argument is validated before the
//! scheduler is touched, so a refused call changes nothing; integers that do not fit raise
//! `InvalidArgumentError`, not `OverflowError`.

use std::time::Instant;

use numpy::ndarray::Array2;
use numpy::prelude::*;
use numpy::{PyArray1, PyArray2, PyUntypedArray};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::arrays::invalid;
use crate::error::KvError;
use crate::prefix_cache::PrefixMode;
use crate::request::{FinishedSeq, NewRequest};
use crate::sched::{Policy, Scheduler, SchedulerConfig, SchedulerStats, StepPlan};

/// Reads a 1-D NumPy integer array (any integer dtype) as i64; `None` if `obj` is no array.
fn int_array(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Vec<i64>>> {
    macro_rules! read {
        ($t:ty) => {
            if let Ok(a) = obj.cast::<PyArray1<$t>>() {
                let ro = a.readonly();
                let v: Vec<i64> = match ro.as_slice() {
                    Ok(s) => s.iter().map(|&x| x as i64).collect(),
                    Err(_) => ro.as_array().iter().map(|&x| x as i64).collect(),
                };
                return Ok(Some(v));
            }
        };
    }
    read!(i64);
    read!(i32);
    read!(u32);
    read!(i16);
    read!(u16);
    read!(i8);
    read!(u8);
    if let Ok(a) = obj.cast::<PyArray1<u64>>() {
        let ro = a.readonly();
        let v: Option<Vec<i64>> = ro
            .as_array()
            .iter()
            .map(|&x| i64::try_from(x).ok())
            .collect();
        return v
            .map(Some)
            .ok_or_else(|| invalid(format!("{name}: a value exceeds the int64 range")));
    }
    if obj.cast::<PyUntypedArray>().is_ok() {
        return Err(invalid(format!("{name} must be a 1-D integer array")));
    }
    Ok(None)
}

/// An integer array, or a sequence of Python ints, as i64 values.
fn ints(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if let Some(v) = int_array(obj, name)? {
        return Ok(v);
    }
    obj.extract::<Vec<i64>>().map_err(|_| {
        invalid(format!(
            "{name} must be a 1-D integer array or a sequence of ints"
        ))
    })
}

/// Like `ints`, but a Python int is repeated `len` times; `None` gives `default`.
fn ints_or_scalar(
    obj: Option<&Bound<'_, PyAny>>,
    len: usize,
    default: i64,
    name: &str,
) -> PyResult<Vec<i64>> {
    let Some(obj) = obj else {
        return Ok(vec![default; len]);
    };
    if let Ok(x) = obj.extract::<i64>() {
        if obj.cast::<PyUntypedArray>().is_err() {
            return Ok(vec![x; len]);
        }
    }
    let v = ints(obj, name)?;
    if v.len() != len {
        return Err(invalid(format!(
            "{name} has {} entries for {len} requests",
            v.len()
        )));
    }
    Ok(v)
}

/// Converts with a range check into `T` (u32, i32, u64...), naming the argument on failure.
fn conv<T: TryFrom<i64>>(v: i64, name: &str) -> PyResult<T> {
    T::try_from(v).map_err(|_| invalid(format!("{name}: value {v} out of range")))
}

fn conv_all<T: TryFrom<i64>>(v: &[i64], name: &str) -> PyResult<Vec<T>> {
    v.iter().map(|&x| conv(x, name)).collect()
}

/// Splits `flat` by `offsets` ([k + 1], starting at 0, non-decreasing, ending at len).
fn split(flat: &[u32], offsets: &[i64], k: usize, name: &str) -> PyResult<Vec<Vec<u32>>> {
    if offsets.len() != k + 1 {
        return Err(invalid(format!(
            "{name} offsets need {} entries, got {}",
            k + 1,
            offsets.len()
        )));
    }
    let ok = offsets[0] == 0
        && offsets.windows(2).all(|w| w[0] <= w[1])
        && offsets[k] == flat.len() as i64;
    if !ok {
        return Err(invalid(format!(
            "{name} offsets must start at 0, not decrease and end at {}",
            flat.len()
        )));
    }
    Ok(offsets
        .windows(2)
        .map(|w| flat[w[0] as usize..w[1] as usize].to_vec())
        .collect())
}

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
    copy_ops: Py<PyArray2<i32>>,
    logits_indices: Py<PyArray1<i64>>,
    sample_rows: Py<PyArray1<i32>>,
    sample_req_ids: Py<PyArray1<i64>>,
    sample_seq_index: Py<PyArray1<i32>>,
}

impl PyStepPlan {
    fn new(py: Python<'_>, p: StepPlan) -> PyResult<Self> {
        let (num_reqs, num_ops) = (p.num_reqs(), p.copy_ops.len() / 2);
        Ok(PyStepPlan {
            step_id: p.step_id,
            num_reqs,
            num_tokens: p.num_tokens(),
            num_decode: p.num_decode,
            num_prefill: p.num_prefill,
            num_sampled: p.num_sampled(),
            max_query_len: p.max_query_len,
            max_seq_len: p.max_seq_len,
            block_table: arr2(py, p.block_table, num_reqs, p.max_blocks)?,
            copy_ops: arr2(py, p.copy_ops, num_ops, 2)?,
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
}

impl PyStepOutput {
    fn new(py: Python<'_>, fs: Vec<FinishedSeq>) -> PyResult<Self> {
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
        })
    }
}

/// `(req_id, seq_index, finish_reason, token_ids)`.
type OutputTuple = (i64, i32, String, Vec<i64>);

#[pymethods]
impl PyStepOutput {
    /// `[(req_id, seq_index, finish_reason, token_ids)]`, one tuple per finished sample.
    fn outputs(&self, py: Python<'_>) -> PyResult<Vec<OutputTuple>> {
        let ids = self.req_ids.bind(py).readonly();
        let idx = self.seq_index.bind(py).readonly();
        let off = self.token_offsets.bind(py).readonly();
        let tok = self.token_ids.bind(py).readonly();
        let (ids, idx, off, tok) = (
            ids.as_array(),
            idx.as_array(),
            off.as_array(),
            tok.as_array(),
        );
        let reasons = self.finish_reasons.bind(py);
        (0..self.num_finished)
            .map(|i| {
                let toks = (off[i] as usize..off[i + 1] as usize)
                    .map(|t| tok[t])
                    .collect();
                Ok((
                    ids[i],
                    idx[i],
                    reasons.get_item(i)?.extract::<String>()?,
                    toks,
                ))
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

/// The continuous-batching scheduler (documented in `_kvcore.pyi`).
#[pyclass(name = "Scheduler", module = "kvcore._kvcore")]
pub struct PyScheduler {
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size=16, max_num_batched_tokens=8192, max_num_seqs=256,
        max_model_len=8192, prefix_mode="radix", policy="fcfs", long_prefill_token_threshold=0,
        watermark=0.01, eos_token_id=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: i64,
        block_size: i64,
        max_num_batched_tokens: i64,
        max_num_seqs: i64,
        max_model_len: i64,
        prefix_mode: &str,
        policy: &str,
        long_prefill_token_threshold: i64,
        watermark: f64,
        eos_token_id: Option<i64>,
    ) -> PyResult<Self> {
        let mut cfg = SchedulerConfig::new(
            conv(num_blocks, "num_blocks")?,
            conv(block_size, "block_size")?,
        );
        cfg.max_num_batched_tokens = conv(max_num_batched_tokens, "max_num_batched_tokens")?;
        cfg.max_num_seqs = conv(max_num_seqs, "max_num_seqs")?;
        cfg.max_model_len = conv(max_model_len, "max_model_len")?;
        cfg.prefix_mode = PrefixMode::parse(prefix_mode)?;
        cfg.policy = match policy {
            "fcfs" => Policy::Fcfs,
            "priority" => Policy::Priority,
            _ => {
                return Err(invalid(format!(
                    "policy must be 'fcfs' or 'priority', got {policy:?}"
                )))
            }
        };
        cfg.long_prefill_token_threshold =
            conv(long_prefill_token_threshold, "long_prefill_token_threshold")?;
        cfg.watermark = watermark;
        cfg.eos_token_id = eos_token_id.map(|t| conv(t, "eos_token_id")).transpose()?;
        Ok(PyScheduler {
            inner: Scheduler::new(cfg)?,
        })
    }

    #[pyo3(signature = (
        req_ids, prompt_token_ids, prompt_offsets, max_tokens, *, priorities=None,
        namespaces=None, n=None, ignore_eos=None, stop_token_ids=None, stop_offsets=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_requests(
        &mut self,
        req_ids: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        prompt_offsets: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        priorities: Option<&Bound<'_, PyAny>>,
        namespaces: Option<&Bound<'_, PyAny>>,
        n: Option<&Bound<'_, PyAny>>,
        ignore_eos: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        stop_offsets: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ids: Vec<u64> = conv_all(&ints(req_ids, "req_ids")?, "req_ids")?;
        let k = ids.len();
        let tokens: Vec<u32> = conv_all(
            &ints(prompt_token_ids, "prompt_token_ids")?,
            "prompt_token_ids",
        )?;
        let prompts = split(
            &tokens,
            &ints(prompt_offsets, "prompt_offsets")?,
            k,
            "prompt",
        )?;
        let max_tokens: Vec<u32> = conv_all(
            &ints_or_scalar(Some(max_tokens), k, 0, "max_tokens")?,
            "max_tokens",
        )?;
        let priorities: Vec<i32> = conv_all(
            &ints_or_scalar(priorities, k, 0, "priorities")?,
            "priorities",
        )?;
        let namespaces: Vec<u64> = conv_all(
            &ints_or_scalar(namespaces, k, 0, "namespaces")?,
            "namespaces",
        )?;
        let ns: Vec<u32> = conv_all(&ints_or_scalar(n, k, 1, "n")?, "n")?;
        let ignore: Vec<i64> = match ignore_eos {
            None => vec![0; k],
            Some(o) => match o.extract::<bool>() {
                Ok(b) => vec![i64::from(b); k],
                Err(_) => match o.extract::<Vec<bool>>() {
                    Ok(v) => v.into_iter().map(i64::from).collect(),
                    Err(_) => ints_or_scalar(Some(o), k, 0, "ignore_eos")?,
                },
            },
        };
        if ignore.len() != k {
            return Err(invalid(format!(
                "ignore_eos has {} entries for {k} requests",
                ignore.len()
            )));
        }
        let stops = match (stop_token_ids, stop_offsets) {
            (None, None) => vec![Vec::new(); k],
            (Some(t), Some(o)) => {
                let flat: Vec<u32> = conv_all(&ints(t, "stop_token_ids")?, "stop_token_ids")?;
                split(&flat, &ints(o, "stop_offsets")?, k, "stop")?
            }
            _ => {
                return Err(invalid(
                    "stop_token_ids and stop_offsets go together".into(),
                ))
            }
        };
        let reqs = (0..k)
            .zip(prompts)
            .zip(stops)
            .map(|((i, prompt), stop)| NewRequest {
                id: ids[i],
                prompt,
                max_tokens: max_tokens[i],
                priority: priorities[i],
                namespace: namespaces[i],
                n: ns[i],
                ignore_eos: ignore[i] != 0,
                stop_token_ids: stop,
            })
            .collect();
        Ok(self.inner.add_requests(reqs)?)
    }

    #[pyo3(signature = (
        req_id, prompt_token_ids, max_tokens, *, priority=0, namespace=0, n=1, ignore_eos=false,
        stop_token_ids=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        req_id: i64,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        priority: i64,
        namespace: i64,
        n: i64,
        ignore_eos: bool,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let stops = match stop_token_ids {
            None => Vec::new(),
            Some(s) => conv_all(&ints(s, "stop_token_ids")?, "stop_token_ids")?,
        };
        let r = NewRequest {
            id: conv(req_id, "req_id")?,
            prompt: conv_all(
                &ints(prompt_token_ids, "prompt_token_ids")?,
                "prompt_token_ids",
            )?,
            max_tokens: conv(max_tokens, "max_tokens")?,
            priority: conv(priority, "priority")?,
            namespace: conv(namespace, "namespace")?,
            n: conv(n, "n")?,
            ignore_eos,
            stop_token_ids: stops,
        };
        Ok(self.inner.add_requests(vec![r])?)
    }

    fn abort_requests(
        &mut self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
    ) -> PyResult<PyStepOutput> {
        let ids: Vec<u64> = conv_all(&ints(req_ids, "req_ids")?, "req_ids")?;
        let fs = self.inner.abort_requests(&ids)?;
        PyStepOutput::new(py, fs)
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyStepPlan> {
        let inner = &mut self.inner;
        let plan = py.detach(|| inner.schedule())?;
        PyStepPlan::new(py, plan)
    }

    fn update(
        &mut self,
        py: Python<'_>,
        step_id: i64,
        sampled_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<PyStepOutput> {
        let step: u64 = conv(step_id, "step_id")?;
        let toks = sampled_tokens(sampled_token_ids)?;
        let inner = &mut self.inner;
        let fs = py.detach(|| inner.update(step, &toks))?;
        PyStepOutput::new(py, fs)
    }

    fn stats(&self) -> PySchedulerStats {
        self.inner.stats().into()
    }

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    fn bench_step(&mut self, py: Python<'_>, token_id: i64) -> PyResult<(u64, usize)> {
        let tok: u32 = conv(token_id, "token_id")?;
        let inner = &mut self.inner;
        let r = py.detach(|| -> Result<(u64, usize), KvError> {
            let t0 = Instant::now();
            let plan = inner.schedule()?;
            let sampled = vec![tok; plan.num_sampled()];
            let fs = inner.update(plan.step_id, &sampled)?;
            Ok((t0.elapsed().as_nanos() as u64, fs.len()))
        })?;
        Ok(r)
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.config().num_blocks
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.config().block_size
    }

    #[getter]
    fn max_num_batched_tokens(&self) -> u32 {
        self.inner.config().max_num_batched_tokens
    }

    #[getter]
    fn max_num_seqs(&self) -> u32 {
        self.inner.config().max_num_seqs
    }

    #[getter]
    fn max_model_len(&self) -> u32 {
        self.inner.config().max_model_len
    }

    #[getter]
    fn prefix_mode(&self) -> &'static str {
        self.inner.config().prefix_mode.name()
    }

    #[getter]
    fn policy(&self) -> &'static str {
        match self.inner.config().policy {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }

    #[getter]
    fn eos_token_id(&self) -> Option<u32> {
        self.inner.config().eos_token_id
    }

    #[getter]
    fn outstanding_step(&self) -> Option<u64> {
        self.inner.outstanding_step()
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!(
            "Scheduler(num_blocks={}, block_size={}, max_num_batched_tokens={}, max_num_seqs={}, \
             max_model_len={}, prefix_mode={:?}, policy={:?})",
            c.num_blocks,
            c.block_size,
            c.max_num_batched_tokens,
            c.max_num_seqs,
            c.max_model_len,
            c.prefix_mode.name(),
            self.policy()
        )
    }
}

/// The sampled tokens: a 1-D int32 or int64 NumPy array of token ids in `[0, 2**32)`.
fn sampled_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let bad = |i: usize, v: i64| invalid(format!("sampled_token_ids[{i}] = {v} is not a token id"));
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let ro = a.readonly();
        let arr = ro.as_array();
        let mut out = Vec::with_capacity(arr.len());
        for (i, &v) in arr.iter().enumerate() {
            out.push(u32::try_from(v).map_err(|_| bad(i, i64::from(v)))?);
        }
        return Ok(out);
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let ro = a.readonly();
        let arr = ro.as_array();
        let mut out = Vec::with_capacity(arr.len());
        for (i, &v) in arr.iter().enumerate() {
            out.push(u32::try_from(v).map_err(|_| bad(i, v))?);
        }
        return Ok(out);
    }
    let what = match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!("a {}-D array of dtype {}", a.ndim(), a.dtype()),
        Err(_) => format!("a {}", obj.get_type().name()?),
    };
    Err(invalid(format!(
        "sampled_token_ids must be a 1-D int32 or int64 NumPy array, got {what}"
    )))
}

/// Adds the scheduler classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PyStepOutput>()?;
    m.add_class::<PySchedulerStats>()?;
    Ok(())
}
