//! `KvCacheManager`: the batch Python API over `KvManager`.
//!
//! Every call takes many requests at once (ids, counts and tokens as 1-D integer arrays,
//! sequences of ints, or one int for a batch of one; tokens as one flat array plus offsets),
//! so one crossing of the PyO3 boundary serves a whole batch. Each call validates the whole
//! batch first (types, shapes, ranges, ids, the tokens each request holds) and raises before
//! changing anything; running out of blocks is not an error: `admit` and `allocate_slots` stop
//! at the first request that does not fit and report how far they got.
//!
//! Threads: the manager sits behind a lock (`lock::Shared`): calls from several threads are
//! serialized, each atomic; heavy calls release the GIL while they work.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{count, id, int64, int_in, or_default, text};
use super::arrays::{counts, counts_for, ids, ids_for, int_batch, same_len};
use super::errors::invalid;
use super::lock::Shared;
use super::manager_args::{
    block_id, check_live, check_spans, consistent_repeats, token_spans, too_long, unique,
};
use crate::error::{KvError, KvResult};
use crate::kv_manager::{KvManager, KvManagerConfig, PrefixHit, MAX_BLOCKS, MAX_BLOCK_SIZE};
use crate::prefix::PrefixMode;

/// Python wrapper of [`KvManager`], exposed as `kvcore.KvCacheManager`.
#[pyclass(name = "KvCacheManager", module = "kvcore._kvcore", frozen)]
pub struct PyKvCacheManager {
    inner: Shared<KvManager>,
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size = None, prefix_mode = None),
        text_signature = "(num_blocks, block_size=16, prefix_mode='radix')"
    )]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: Option<&Bound<'_, PyAny>>,
        prefix_mode: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let num_blocks = int_in(num_blocks, "num_blocks", 2, i64::from(MAX_BLOCKS))?;
        let block_size = or_default(block_size, 16, |o| {
            int_in(o, "block_size", 1, i64::from(MAX_BLOCK_SIZE))
        })?;
        let mode = or_default(prefix_mode, "radix".into(), |o| text(o, "prefix_mode"))?;
        let inner = KvManager::new(KvManagerConfig {
            num_blocks,
            block_size,
            prefix_mode: PrefixMode::parse(&mode)?,
        })?;
        Ok(PyKvCacheManager {
            inner: Shared::new(inner),
        })
    }

    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<u32> {
        self.inner.with(py, |m| m.num_blocks())
    }

    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<u32> {
        self.inner.with(py, |m| m.block_size())
    }

    #[getter]
    fn prefix_mode(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.inner.with(py, |m| m.prefix_mode().name())
    }

    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<u32> {
        self.inner.with(py, |m| m.num_free_blocks())
    }

    #[getter]
    fn num_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.with(py, |m| m.num_requests())
    }

    #[getter]
    fn usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.inner.with(py, |m| m.usage())
    }

    #[pyo3(signature = (tokens, offsets = None, namespaces = None))]
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        offsets: Option<&Bound<'py, PyAny>>,
        namespaces: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let n = match offsets.filter(|o| !o.is_none()) {
            Some(o) => counts(o, "offsets")?.len().saturating_sub(1),
            None => 1,
        };
        let (t, sp) = token_spans(Some(tokens), offsets, n)?.expect("tokens given");
        let ns = ids_for(namespaces, "namespaces", n)?;
        let toks = t.slice();
        let hits = self.inner.detached(py, |m| {
            sp.iter()
                .zip(&ns)
                .map(|(&(s, e), &ns)| {
                    m.match_prefix(ns, &toks[s..e], (e - s).saturating_sub(1))
                        .num_tokens as i64
                })
                .collect::<Vec<i64>>()
        })?;
        Ok(PyArray1::from_vec(py, hits))
    }

    #[pyo3(
        signature = (req_ids, num_tokens, tokens = None, offsets = None, namespaces = None, watermark_blocks = None),
        text_signature = "(self, req_ids, num_tokens, tokens=None, offsets=None, namespaces=None, watermark_blocks=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn admit<'py>(
        &self,
        py: Python<'py>,
        req_ids: &Bound<'py, PyAny>,
        num_tokens: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
        offsets: Option<&Bound<'py, PyAny>>,
        namespaces: Option<&Bound<'py, PyAny>>,
        watermark_blocks: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let reqs = ids(req_ids, "req_ids")?;
        let n = reqs.len();
        let totals = counts_for(num_tokens, "num_tokens", n)?;
        let ts = token_spans(tokens, offsets, n)?;
        let ns = ids_for(namespaces, "namespaces", n)?;
        let wm = or_default(watermark_blocks, 0u32, |o| {
            count(o, "watermark_blocks", i64::from(u32::MAX))
        })?;
        unique(&reqs, KvError::DuplicateRequest)?;
        for (i, &total) in totals.iter().enumerate() {
            if total == 0 {
                return Err(invalid(format!(
                    "request {}: num_tokens must be at least 1",
                    reqs[i]
                )));
            }
            if matches!(&ts, Some((_, sp)) if sp[i].0 == sp[i].1) {
                return Err(invalid(format!("request {}: empty prompt", reqs[i])));
            }
        }
        let ts = ts.as_ref().map(|(t, sp)| (t.slice(), sp));
        let hits = self.inner.detached(py, |m| -> KvResult<Vec<i64>> {
            if let Some(&r) = reqs.iter().find(|&&r| m.contains(r)) {
                return Err(KvError::DuplicateRequest(r));
            }
            too_long(m, &reqs, &totals)?;
            let mut hits = Vec::with_capacity(n);
            let empty = PrefixHit::default();
            for i in 0..n {
                let (toks, hit) = match &ts {
                    Some((t, sp)) => {
                        let toks = &t[sp[i].0..sp[i].1];
                        let cap = toks.len().min(totals[i]) - 1;
                        (toks, m.match_prefix(ns[i], toks, cap))
                    }
                    None => (&[][..], empty.clone()),
                };
                let new = totals[i] - hit.num_tokens;
                if !m.admit(reqs[i], ns[i], toks, &hit, new, wm)? {
                    break;
                }
                hits.push(hit.num_tokens as i64);
            }
            Ok(hits)
        })??;
        Ok(PyArray1::from_vec(py, hits))
    }

    fn allocate_slots(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        num_total_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let reqs = ids(req_ids, "req_ids")?;
        let totals = counts_for(num_total_tokens, "num_total_tokens", reqs.len())?;
        Ok(self.inner.detached(py, |m| -> KvResult<usize> {
            check_live(m, &reqs)?;
            too_long(m, &reqs, &totals)?;
            for (i, (&r, &t)) in reqs.iter().zip(&totals).enumerate() {
                if !m.allocate_slots(r, t)? {
                    return Ok(i);
                }
            }
            Ok(reqs.len())
        })??)
    }

    #[pyo3(signature = (req_ids, tokens, offsets = None))]
    fn cache_computed(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        offsets: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let reqs = ids(req_ids, "req_ids")?;
        let (t, sp) = token_spans(Some(tokens), offsets, reqs.len())?.expect("tokens given");
        let toks = t.slice();
        consistent_repeats(&reqs, toks, &sp)?;
        Ok(self.inner.detached(py, |m| -> KvResult<()> {
            check_live(m, &reqs)?;
            check_spans(m, &reqs, toks, &sp)?;
            for (&r, &(s, e)) in reqs.iter().zip(&sp) {
                m.cache_checked(r, &toks[s..e]);
            }
            Ok(())
        })??)
    }

    #[pyo3(signature = (req_ids, tokens = None, offsets = None))]
    fn free(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        tokens: Option<&Bound<'_, PyAny>>,
        offsets: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let reqs = ids(req_ids, "req_ids")?;
        let ts = token_spans(tokens, offsets, reqs.len())?;
        unique(&reqs, |r| {
            KvError::DoubleFree(format!("request {r} is freed twice in one batch"))
        })?;
        let ts = ts.as_ref().map(|(t, sp)| (t.slice(), sp));
        Ok(self.inner.detached(py, |m| -> KvResult<()> {
            check_live(m, &reqs)?;
            if let Some((t, sp)) = &ts {
                check_spans(m, &reqs, t, sp)?;
            }
            for (i, &r) in reqs.iter().enumerate() {
                match &ts {
                    Some((t, sp)) => m.free_checked(r, &t[sp[i].0..sp[i].1]),
                    None => m.free_checked(r, &[]),
                }
            }
            Ok(())
        })??)
    }

    fn fork(
        &self,
        py: Python<'_>,
        parent_ids: &Bound<'_, PyAny>,
        child_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let parents = ids(parent_ids, "parent_ids")?;
        let children = ids(child_ids, "child_ids")?;
        same_len("child_ids", children.len(), parents.len())?;
        unique(&children, KvError::DuplicateRequest)?;
        Ok(self.inner.with(py, |m| -> KvResult<()> {
            check_live(m, &parents)?;
            if let Some(&c) = children.iter().find(|&&c| m.contains(c)) {
                return Err(KvError::DuplicateRequest(c));
            }
            for (&p, &c) in parents.iter().zip(&children) {
                m.fork(p, c)?;
            }
            Ok(())
        })??)
    }

    fn block_table<'py>(
        &self,
        py: Python<'py>,
        req_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let req = id(req_id, "req_id")?;
        let t = self.inner.with(py, |m| -> KvResult<Vec<i32>> {
            Ok(m.block_table(req)?.iter().map(|&b| b as i32).collect())
        })??;
        Ok(PyArray1::from_vec(py, t))
    }

    #[pyo3(signature = (req_ids, width = None))]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        req_ids: &Bound<'py, PyAny>,
        width: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let reqs = ids(req_ids, "req_ids")?;
        let width = or_default(width, None, |o| count(o, "width", i64::MAX).map(Some))?;
        let (flat, w) = self.inner.with(py, |m| -> KvResult<(Vec<i32>, usize)> {
            check_live(m, &reqs)?;
            let longest = reqs
                .iter()
                .map(|&r| m.block_table(r).map_or(0, |t| t.len()))
                .max()
                .unwrap_or(0);
            let w = width.unwrap_or(longest);
            if w < longest {
                return Err(KvError::InvalidArgument(format!(
                    "width {w} is narrower than the longest table ({longest} blocks)"
                )));
            }
            // No table can hold more than every block of the pool: a wider request is a mistake.
            if w > m.num_blocks() as usize {
                return Err(KvError::InvalidArgument(format!(
                    "width {w} exceeds the pool ({} blocks)",
                    m.num_blocks()
                )));
            }
            let mut out = vec![0i32; reqs.len() * w];
            for (row, &r) in reqs.iter().enumerate() {
                for (j, &b) in m.block_table(r)?.iter().enumerate() {
                    out[row * w + j] = b as i32;
                }
            }
            Ok((out, w))
        })??;
        PyArray1::from_vec(py, flat).reshape([reqs.len(), w])
    }

    fn drain_copy_ops<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let ops = self.inner.with(py, |m| {
            let mut ops = Vec::new();
            m.drain_copy_ops(&mut ops);
            ops
        })?;
        let flat: Vec<i32> = ops
            .iter()
            .flat_map(|op| [op[0] as i32, op[1] as i32])
            .collect();
        PyArray1::from_vec(py, flat).reshape([ops.len(), 2])
    }

    fn ref_counts<'py>(
        &self,
        py: Python<'py>,
        block_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let blocks = int_batch(block_ids, "block_ids", true)?;
        let out = self.inner.with(py, |m| -> KvResult<Vec<i64>> {
            blocks
                .iter()
                .map(|&b| Ok(i64::from(m.ref_count(block_id(m, Some(b))?)?)))
                .collect()
        })??;
        Ok(PyArray1::from_vec(py, out))
    }

    fn free_queue<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let q = self.inner.with(py, |m| {
            m.free_queue()
                .into_iter()
                .map(|b| b as i32)
                .collect::<Vec<i32>>()
        })?;
        Ok(PyArray1::from_vec(py, q))
    }

    fn block_hash(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<Option<u128>> {
        let b = int64(block_id, "block_id")?;
        Ok(self.inner.with(py, |m| -> KvResult<Option<u128>> {
            Ok(m.block_hash(self::block_id(m, b)?))
        })??)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.with(py, |m| m.stats())?;
        let d = PyDict::new(py);
        d.set_item("queries", s.queries)?;
        d.set_item("query_tokens", s.query_tokens)?;
        d.set_item("hit_tokens", s.hit_tokens)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("cached_blocks", s.cached_blocks)?;
        d.set_item("copy_ops", s.copy_ops)?;
        d.set_item("deduplicated_blocks", s.deduplicated_blocks)?;
        Ok(d)
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        Ok(self.inner.detached(py, |m| m.check_invariants())??)
    }

    /// False for anything but a live request id (never raises).
    fn __contains__(&self, py: Python<'_>, req_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        match id(req_id, "req_id") {
            Ok(r) => self.inner.with(py, |m| m.contains(r)),
            Err(_) => Ok(false),
        }
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.with(py, |m| m.num_requests())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.inner.with(py, |m| {
            format!(
                "KvCacheManager(num_blocks={}, block_size={}, prefix_mode='{}', \
                 num_free_blocks={}, num_requests={})",
                m.num_blocks(),
                m.block_size(),
                m.prefix_mode().name(),
                m.num_free_blocks(),
                m.num_requests()
            )
        })
    }
}
