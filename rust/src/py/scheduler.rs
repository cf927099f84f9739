//! Python binding of the scheduler: `Scheduler` (its result types are in `step_output.rs`).
//!
//! Two boundary crossings per step: `schedule()` returns a `StepPlan` whose arrays are the
//! Rust vectors handed to NumPy without a copy (`PyArray::from_vec`), and `update()` takes the
//! sampled tokens as one NumPy array. Admission and abort are batched (flat arrays + offsets).
//! The heavy Rust work runs with the GIL released. Every argument is validated before the
//! scheduler is touched, so a refused call changes nothing; every bad argument (a wrong type,
//! an integer that does not fit) raises `InvalidArgumentError`, never `TypeError` or
//! `OverflowError`. The scheduler sits behind a lock (`lock::Shared`): calls from several
//! threads are serialized, each atomic.

use std::time::Instant;

use pyo3::prelude::*;

use super::args::{count, flag, id, int_in, or_default, real, text};
use super::arrays::{conv_all, int_batch, ints, ints_or_scalar};
use super::errors::invalid;
use super::lock::Shared;
use super::sched_args::{sampled_tokens, split};
use super::step_output::{PySchedulerStats, PyStepOutput, PyStepPlan};
use crate::error::KvError;
use crate::prefix::PrefixMode;
use crate::request::{NewRequest, Retention};
use crate::sched::{Policy, Scheduler, SchedulerConfig};

type I64Array = Py<numpy::PyArray1<i64>>;

/// The continuous-batching scheduler (documented in `_kvcore.pyi`).
#[pyclass(name = "Scheduler", module = "kvcore._kvcore", frozen)]
pub struct PyScheduler {
    pub(super) inner: Shared<Scheduler>,
    /// A copy of the (immutable) configuration, read without the lock.
    cfg: SchedulerConfig,
}

/// A `u32` count argument.
fn u32_arg(obj: Option<&Bound<'_, PyAny>>, default: u32, name: &str) -> PyResult<u32> {
    or_default(obj, default, |o| count(o, name, i64::from(u32::MAX)))
}

/// `ignore_eos`: one bool for all, or one per request (bools or 0/1 ints).
fn ignore_flags(obj: Option<&Bound<'_, PyAny>>, k: usize) -> PyResult<Vec<bool>> {
    let Some(o) = obj.filter(|o| !o.is_none()) else {
        return Ok(vec![false; k]);
    };
    if let Ok(b) = flag(o, "ignore_eos") {
        return Ok(vec![b; k]);
    }
    let v = match o.extract::<Vec<bool>>() {
        Ok(v) => v,
        Err(_) => ints(o, "ignore_eos")?.into_iter().map(|x| x != 0).collect(),
    };
    if v.len() != k {
        return Err(invalid(format!(
            "ignore_eos has {} entries for {k} requests",
            v.len()
        )));
    }
    Ok(v)
}

/// A lossy policy from its block counts: a window of 0 blocks means none (keep everything);
/// sinks without a window are refused.
fn retention(sink_blocks: u32, window_blocks: u32) -> PyResult<Option<Retention>> {
    if window_blocks == 0 && sink_blocks > 0 {
        return Err(invalid(format!(
            "retention_sink = {sink_blocks} needs a retention_window of at least 1 block"
        )));
    }
    Ok((window_blocks > 0).then_some(Retention {
        sink_blocks,
        window_blocks,
    }))
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(
        signature = (
            num_blocks, block_size=None, max_num_batched_tokens=None, max_num_seqs=None,
            max_model_len=None, prefix_mode=None, policy=None, long_prefill_token_threshold=None,
            watermark=None, eos_token_id=None, enable_chunked_prefill=None, host_blocks=None,
            tier_fetch=None, tier_publish=None, tier_root=None, bytes_per_block=None,
            preemption=None, sliding_window=None, group_windows=None
        ),
        text_signature = "(num_blocks, block_size=16, max_num_batched_tokens=8192, \
            max_num_seqs=256, max_model_len=8192, prefix_mode='radix', policy='fcfs', \
            long_prefill_token_threshold=0, watermark=0.01, eos_token_id=None, \
            enable_chunked_prefill=True, host_blocks=0, tier_fetch=False, tier_publish=False, \
            tier_root=None, bytes_per_block=1, preemption='recompute', sliding_window=0, \
            group_windows=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<&Bound<'_, PyAny>>,
        max_num_batched_tokens: Option<&Bound<'_, PyAny>>,
        max_num_seqs: Option<&Bound<'_, PyAny>>,
        max_model_len: Option<&Bound<'_, PyAny>>,
        prefix_mode: Option<&Bound<'_, PyAny>>,
        policy: Option<&Bound<'_, PyAny>>,
        long_prefill_token_threshold: Option<&Bound<'_, PyAny>>,
        watermark: Option<&Bound<'_, PyAny>>,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        enable_chunked_prefill: Option<&Bound<'_, PyAny>>,
        host_blocks: Option<&Bound<'_, PyAny>>,
        tier_fetch: Option<&Bound<'_, PyAny>>,
        tier_publish: Option<&Bound<'_, PyAny>>,
        tier_root: Option<&Bound<'_, PyAny>>,
        bytes_per_block: Option<&Bound<'_, PyAny>>,
        preemption: Option<&Bound<'_, PyAny>>,
        sliding_window: Option<&Bound<'_, PyAny>>,
        group_windows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut cfg = SchedulerConfig::new(
            u32_arg(Some(num_blocks), 0, "num_blocks")?,
            u32_arg(block_size, 16, "block_size")?,
        );
        cfg.max_num_batched_tokens =
            u32_arg(max_num_batched_tokens, 8192, "max_num_batched_tokens")?;
        cfg.max_num_seqs = u32_arg(max_num_seqs, 256, "max_num_seqs")?;
        cfg.max_model_len = u32_arg(max_model_len, 8192, "max_model_len")?;
        let mode = or_default(prefix_mode, "radix".into(), |o| text(o, "prefix_mode"))?;
        cfg.prefix_mode = PrefixMode::parse(&mode)?;
        let policy = or_default(policy, "fcfs".into(), |o| text(o, "policy"))?;
        cfg.policy = match policy.as_str() {
            "fcfs" => Policy::Fcfs,
            "priority" => Policy::Priority,
            _ => {
                return Err(invalid(format!(
                    "policy must be 'fcfs' or 'priority', got {policy:?}"
                )))
            }
        };
        cfg.long_prefill_token_threshold = u32_arg(
            long_prefill_token_threshold,
            0,
            "long_prefill_token_threshold",
        )?;
        cfg.enable_chunked_prefill = or_default(enable_chunked_prefill, true, |o| {
            flag(o, "enable_chunked_prefill")
        })?;
        cfg.watermark = or_default(watermark, 0.01, |o| real(o, "watermark"))?;
        cfg.sliding_window = u32_arg(sliding_window, 0, "sliding_window")?;
        cfg.group_windows = match group_windows.filter(|o| !o.is_none()) {
            None => Vec::new(),
            Some(o) => conv_all(&ints(o, "group_windows")?, "group_windows")?,
        };
        cfg.eos_token_id = or_default(eos_token_id, None, |o| {
            count(o, "eos_token_id", i64::from(u32::MAX)).map(Some)
        })?;
        let root = match tier_root.filter(|o| !o.is_none()) {
            None => None,
            Some(o) => Some(
                o.extract::<Vec<u8>>()
                    .map_err(|_| invalid("tier_root must be bytes (32 of them)".into()))?,
            ),
        };
        cfg.tiers = super::tiers::tier_config(
            or_default(host_blocks, 0i64, |o| {
                count::<i64>(o, "host_blocks", i64::from(u32::MAX))
            })?,
            or_default(tier_fetch, false, |o| flag(o, "tier_fetch"))?,
            or_default(tier_publish, false, |o| flag(o, "tier_publish"))?,
            root,
            or_default(bytes_per_block, 1i64, |o| {
                count::<i64>(o, "bytes_per_block", i64::MAX)
            })?,
            &or_default(preemption, "recompute".into(), |o| text(o, "preemption"))?,
        )?;
        let inner = Scheduler::new(cfg.clone())?;
        Ok(PyScheduler {
            inner: Shared::new(inner),
            cfg,
        })
    }

    #[pyo3(signature = (
        req_ids, prompt_token_ids, prompt_offsets, max_tokens, *, priorities=None,
        namespaces=None, n=None, ignore_eos=None, stop_token_ids=None, stop_offsets=None,
        retention_sink=None, retention_window=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_requests(
        &self,
        py: Python<'_>,
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
        retention_sink: Option<&Bound<'_, PyAny>>,
        retention_window: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ids: Vec<u64> = conv_all(&int_batch(req_ids, "req_ids", true)?, "req_ids")?;
        let k = ids.len();
        let tokens: Vec<u32> = conv_all(
            &int_batch(prompt_token_ids, "prompt_token_ids", true)?,
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
        let ignore = ignore_flags(ignore_eos, k)?;
        let stop_token_ids = stop_token_ids.filter(|o| !o.is_none());
        let stop_offsets = stop_offsets.filter(|o| !o.is_none());
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
        let sinks: Vec<u32> = conv_all(
            &ints_or_scalar(retention_sink, k, 0, "retention_sink")?,
            "retention_sink",
        )?;
        let windows: Vec<u32> = conv_all(
            &ints_or_scalar(retention_window, k, 0, "retention_window")?,
            "retention_window",
        )?;
        let rets = (0..k)
            .map(|i| retention(sinks[i], windows[i]))
            .collect::<PyResult<Vec<_>>>()?;
        let reqs: Vec<NewRequest> = (0..k)
            .zip(prompts)
            .zip(stops)
            .map(|((i, prompt), stop)| NewRequest {
                id: ids[i],
                prompt,
                max_tokens: max_tokens[i],
                priority: priorities[i],
                namespace: namespaces[i],
                n: ns[i],
                ignore_eos: ignore[i],
                stop_token_ids: stop,
                retention: rets[i],
            })
            .collect();
        Ok(self.inner.with(py, |s| s.add_requests(reqs))??)
    }

    #[pyo3(
        signature = (
            req_id, prompt_token_ids, max_tokens, *, priority=None, namespace=None, n=None,
            ignore_eos=None, stop_token_ids=None, retention_sink=None, retention_window=None
        ),
        text_signature = "(self, req_id, prompt_token_ids, max_tokens, *, priority=0, \
            namespace=0, n=1, ignore_eos=False, stop_token_ids=None, retention_sink=0, \
            retention_window=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        req_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        priority: Option<&Bound<'_, PyAny>>,
        namespace: Option<&Bound<'_, PyAny>>,
        n: Option<&Bound<'_, PyAny>>,
        ignore_eos: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        retention_sink: Option<&Bound<'_, PyAny>>,
        retention_window: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let stops = match stop_token_ids.filter(|o| !o.is_none()) {
            None => Vec::new(),
            Some(s) => conv_all(&ints(s, "stop_token_ids")?, "stop_token_ids")?,
        };
        let r = NewRequest {
            id: id(req_id, "req_id")?,
            prompt: conv_all(
                &ints(prompt_token_ids, "prompt_token_ids")?,
                "prompt_token_ids",
            )?,
            max_tokens: count(max_tokens, "max_tokens", i64::from(u32::MAX))?,
            priority: or_default(priority, 0, |o| {
                int_in(o, "priority", i64::from(i32::MIN), i64::from(i32::MAX))
            })?,
            namespace: or_default(namespace, 0, |o| id(o, "namespace"))?,
            n: u32_arg(n, 1, "n")?,
            ignore_eos: or_default(ignore_eos, false, |o| flag(o, "ignore_eos"))?,
            stop_token_ids: stops,
            retention: retention(
                u32_arg(retention_sink, 0, "retention_sink")?,
                u32_arg(retention_window, 0, "retention_window")?,
            )?,
        };
        Ok(self.inner.with(py, |s| s.add_requests(vec![r]))??)
    }

    fn abort_requests(&self, py: Python<'_>, req_ids: &Bound<'_, PyAny>) -> PyResult<PyStepOutput> {
        let ids: Vec<u64> = conv_all(&int_batch(req_ids, "req_ids", true)?, "req_ids")?;
        let fs = self.inner.with(py, |s| s.abort_requests(&ids))??;
        PyStepOutput::new(py, fs)
    }

    fn schedule(&self, py: Python<'_>) -> PyResult<PyStepPlan> {
        let plan = self.inner.detached(py, |s| s.schedule())??;
        PyStepPlan::new(
            py,
            plan,
            self.cfg.block_size as usize,
            self.cfg.group_windows.len(),
        )
    }

    #[pyo3(signature = (step_id, sampled_token_ids, drop_blocks=None))]
    fn update(
        &self,
        py: Python<'_>,
        step_id: &Bound<'_, PyAny>,
        sampled_token_ids: &Bound<'_, PyAny>,
        drop_blocks: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepOutput> {
        let step: u64 = count(step_id, "step_id", i64::MAX)?;
        let toks = sampled_tokens(sampled_token_ids)?;
        let drops: Vec<usize> = match drop_blocks.filter(|o| !o.is_none()) {
            None => Vec::new(),
            Some(o) => conv_all(&ints(o, "drop_blocks")?, "drop_blocks")?,
        };
        if drops.len() % 2 != 0 {
            return Err(invalid(
                "drop_blocks holds (row, block) pairs: an even number of ints".into(),
            ));
        }
        let pairs: Vec<(usize, usize)> = drops.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        let fs = self
            .inner
            .detached(py, |s| s.update_with_drops(step, &toks, &pairs))??;
        PyStepOutput::new(py, fs)
    }

    fn stats(&self, py: Python<'_>) -> PyResult<PySchedulerStats> {
        Ok(self.inner.with(py, |s| s.stats())?.into())
    }

    /// Reports finished fetches (see `_kvcore.pyi`).
    fn tier_fetched(
        &self,
        py: Python<'_>,
        kv_ids: &Bound<'_, PyAny>,
        counts: &Bound<'_, PyAny>,
    ) -> PyResult<(I64Array, I64Array)> {
        let ids: Vec<u64> = conv_all(&ints(kv_ids, "kv_ids")?, "kv_ids")?;
        let n: Vec<usize> = conv_all(&ints(counts, "counts")?, "counts")?;
        let (offsets, slots) = self.inner.with(py, |s| s.tier_fetched(&ids, &n))??;
        let conv64 = |v: Vec<u32>| {
            v.into_iter()
                .map(|x| if x == u32::MAX { -1 } else { i64::from(x) })
        };
        Ok((
            numpy::PyArray1::from_iter(py, conv64(offsets)).unbind(),
            numpy::PyArray1::from_iter(py, conv64(slots)).unbind(),
        ))
    }

    /// Sets the swap cost model's measured rates (see `_kvcore.pyi`).
    fn set_tier_costs(
        &self,
        py: Python<'_>,
        copy_bytes_per_s: &Bound<'_, PyAny>,
        seconds_per_token: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let bw = real(copy_bytes_per_s, "copy_bytes_per_s")?;
        let spt = real(seconds_per_token, "seconds_per_token")?;
        self.inner.with(py, |s| s.set_tier_costs(bw, spt))
    }

    /// Tier counters (see `_kvcore.pyi`).
    fn tier_stats(&self, py: Python<'_>) -> PyResult<std::collections::HashMap<&'static str, u64>> {
        self.inner.with(py, |sched| {
            let s = sched.tier_stats();
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
                ("num_fetching", sched.num_fetching() as u64),
                ("l2_entries", sched.kv().num_l2_entries() as u64),
            ])
        })
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(self.inner.detached(py, |s| s.check_invariants())??)
    }

    fn has_unfinished(&self, py: Python<'_>) -> PyResult<bool> {
        self.inner.with(py, |s| s.has_unfinished())
    }

    fn bench_step(&self, py: Python<'_>, token_id: &Bound<'_, PyAny>) -> PyResult<(u64, usize)> {
        let tok: u32 = count(token_id, "token_id", i64::from(u32::MAX))?;
        let r = self
            .inner
            .detached(py, |s| -> Result<(u64, usize), KvError> {
                let t0 = Instant::now();
                let plan = s.schedule()?;
                let sampled = vec![tok; plan.num_sampled()];
                let fs = s.update(plan.step_id, &sampled)?;
                Ok((t0.elapsed().as_nanos() as u64, fs.len()))
            })??;
        Ok(r)
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.cfg.num_blocks
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.cfg.block_size
    }

    #[getter]
    fn max_num_batched_tokens(&self) -> u32 {
        self.cfg.max_num_batched_tokens
    }

    #[getter]
    fn max_num_seqs(&self) -> u32 {
        self.cfg.max_num_seqs
    }

    #[getter]
    fn max_model_len(&self) -> u32 {
        self.cfg.max_model_len
    }

    #[getter]
    fn prefix_mode(&self) -> &'static str {
        self.cfg.prefix_mode.name()
    }

    #[getter]
    fn policy(&self) -> &'static str {
        match self.cfg.policy {
            Policy::Fcfs => "fcfs",
            Policy::Priority => "priority",
        }
    }

    #[getter]
    fn sliding_window(&self) -> u32 {
        self.cfg.sliding_window
    }

    #[getter]
    fn group_windows(&self) -> Vec<u32> {
        self.cfg.group_windows.clone()
    }

    #[getter]
    fn eos_token_id(&self) -> Option<u32> {
        self.cfg.eos_token_id
    }

    #[getter]
    fn outstanding_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.inner.with(py, |s| s.outstanding_step())
    }

    fn __repr__(&self) -> String {
        let c = &self.cfg;
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
