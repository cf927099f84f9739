//! Python binding of the scheduler: `Scheduler` (its result types are in `step_output.rs`).
//!
//! Two boundary crossings per step: `schedule()` returns a `StepPlan` whose arrays are the
//! Rust vectors handed to NumPy without a copy (`PyArray::from_vec`), and `update()` takes the
//! sampled tokens as one NumPy array. Admission and abort are batched (flat arrays + offsets).
//! The heavy Rust work runs with the GIL released. Every argument is validated before the
//! scheduler is touched, so a refused call changes nothing; integers that do not fit raise
//! `InvalidArgumentError`, not `OverflowError`.

use std::time::Instant;

use pyo3::prelude::*;

use super::arrays::invalid;
use super::sched_args::{conv, conv_all, ints, ints_or_scalar, sampled_tokens, split};
use super::step_output::{PySchedulerStats, PyStepOutput, PyStepPlan};
use crate::error::KvError;
use crate::prefix_cache::PrefixMode;
use crate::request::NewRequest;
use crate::sched::{Policy, Scheduler, SchedulerConfig};

type I64Array = Py<numpy::PyArray1<i64>>;

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
        watermark=0.01, eos_token_id=None, enable_chunked_prefill=true, host_blocks=0,
        tier_fetch=false, tier_publish=false, tier_root=None, bytes_per_block=1,
        preemption="recompute"
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
        enable_chunked_prefill: bool,
        host_blocks: i64,
        tier_fetch: bool,
        tier_publish: bool,
        tier_root: Option<Vec<u8>>,
        bytes_per_block: i64,
        preemption: &str,
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
        cfg.enable_chunked_prefill = enable_chunked_prefill;
        cfg.watermark = watermark;
        cfg.eos_token_id = eos_token_id.map(|t| conv(t, "eos_token_id")).transpose()?;
        cfg.tiers = super::tiers::tier_config(
            host_blocks,
            tier_fetch,
            tier_publish,
            tier_root,
            bytes_per_block,
            preemption,
        )?;
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
        let bs = self.inner.config().block_size as usize;
        PyStepPlan::new(py, plan, bs)
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

    /// Reports finished fetches (see `_kvcore.pyi`).
    fn tier_fetched(
        &mut self,
        py: Python<'_>,
        kv_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<(I64Array, I64Array)> {
        let ids: Vec<u64> = conv_all(&ints(kv_ids, "kv_ids")?, "kv_ids")?;
        let n: Vec<usize> = conv_all(&ints(counts, "counts")?, "counts")?;
        let (offsets, slots) = self.inner.tier_fetched(&ids, &n)?;
        let conv64 = |v: Vec<u32>| {
            v.into_iter()
                .map(|x| if x == u32::MAX { -1 } else { i64::from(x) })
        };
        Ok((
            numpy::PyArray1::from_iter(py, conv64(offsets)).unbind(),
            numpy::PyArray1::from_iter(py, conv64(slots)).unbind(),
        ))
    }

    fn set_tier_costs(&mut self, copy_bytes_per_s: f64, seconds_per_token: f64) {
        self.inner
            .set_tier_costs(copy_bytes_per_s, seconds_per_token);
    }

    fn tier_stats(&self) -> std::collections::HashMap<&'static str, u64> {
        let s = self.inner.tier_stats();
        std::collections::HashMap::from([
            ("l1_hit_tokens", s.l1_hit_tokens),
            ("l2_hit_tokens", s.l2_hit_tokens),
            ("offloaded_blocks", s.offloaded_blocks),
            ("offload_dropped", s.offload_dropped),
            ("loaded_blocks", s.loaded_blocks),
            ("swap_outs", s.swap_outs),
            ("swap_ins", s.swap_ins),
            ("published_blocks", s.published_blocks),
            ("fetch_requests", s.fetch_requests),
            ("fetched_blocks", s.fetched_blocks),
            ("host_evictions", s.host_evictions),
            ("num_fetching", self.inner.num_fetching() as u64),
        ])
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

/// Adds the scheduler classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<super::tiers::PyTierPlan>()?;
    m.add_class::<PyStepOutput>()?;
    m.add_class::<PySchedulerStats>()?;
    Ok(())
}
