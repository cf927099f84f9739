//! `KvCacheManager`: the batch Python API over `KvManager`.
//!
//! Every call takes many requests at once as NumPy arrays (ids `int64`/`uint64`, tokens as one
//! flat `uint32`/`int32` array plus `int64` offsets) and returns arrays, so one crossing of the
//! PyO3 boundary serves a whole batch. Each call validates the whole batch first (dtypes,
//! shapes, ids, lengths) and raises before changing anything; running out of blocks is not an
//! error: `admit` and `allocate_slots` stop at the first request that does not fit and report
//! how far they got. The GIL is released while the core works.

use std::collections::HashSet;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::arrays::{counts, i64s, ids, invalid, same_len, spans, tokens, Tokens};
use crate::error::KvError;
use crate::kv_manager::{KvManager, KvManagerConfig, PrefixHit};
use crate::prefix_cache::PrefixMode;

/// Python wrapper of [`KvManager`], exposed as `kvcore.KvCacheManager`.
#[pyclass(name = "KvCacheManager", module = "kvcore._kvcore")]
pub struct PyKvCacheManager {
    inner: KvManager,
}

/// Flat tokens and each request's `[start, end)` span in them.
type TokenSpans<'py> = (Tokens<'py>, Vec<(usize, usize)>);

/// Optional tokens + offsets, checked together against `n` requests.
fn token_spans<'py>(
    toks: Option<&Bound<'py, PyAny>>,
    offsets: Option<&Bound<'py, PyAny>>,
    n: usize,
) -> PyResult<Option<TokenSpans<'py>>> {
    match (toks, offsets) {
        (None, None) => Ok(None),
        (Some(t), Some(o)) => {
            let t = tokens(t, "tokens")?;
            let sp = spans(&counts(o, "offsets")?, n, t.slice().len())?;
            Ok(Some((t, sp)))
        }
        _ => Err(invalid("tokens and offsets must be given together".into())),
    }
}

fn namespaces(obj: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Vec<u64>> {
    match obj {
        None => Ok(vec![0; n]),
        Some(o) => {
            let v = ids(o, "namespaces")?;
            same_len("namespaces", v.len(), n)?;
            Ok(v)
        }
    }
}

impl PyKvCacheManager {
    fn check_live(&self, reqs: &[u64]) -> PyResult<()> {
        match reqs.iter().find(|&&r| !self.inner.contains(r)) {
            Some(&r) => Err(KvError::UnknownRequest(r).into()),
            None => Ok(()),
        }
    }

    fn check_computed(&self, reqs: &[u64], sp: &[(usize, usize)]) -> PyResult<()> {
        for (&r, &(s, e)) in reqs.iter().zip(sp) {
            let covered = self.inner.num_tokens(r)?;
            if e - s > covered {
                return Err(invalid(format!(
                    "request {r}: {} computed tokens but its table covers {covered}",
                    e - s
                )));
            }
        }
        Ok(())
    }
}

/// Rejects a batch that names the same id twice.
fn unique(reqs: &[u64], dup: impl Fn(u64) -> KvError) -> PyResult<()> {
    let mut seen = HashSet::with_capacity(reqs.len());
    match reqs.iter().find(|&&r| !seen.insert(r)) {
        Some(&r) => Err(dup(r).into()),
        None => Ok(()),
    }
}

#[pymethods]
impl PyKvCacheManager {
    #[new]
    #[pyo3(signature = (num_blocks, block_size = 16, prefix_mode = "radix"))]
    fn new(num_blocks: i64, block_size: i64, prefix_mode: &str) -> PyResult<Self> {
        let num_blocks = u32::try_from(num_blocks)
            .map_err(|_| invalid(format!("num_blocks must be in 2..=2**26, got {num_blocks}")))?;
        let block_size = u32::try_from(block_size)
            .map_err(|_| invalid(format!("block_size must be in 1..=2**16, got {block_size}")))?;
        let prefix_mode = PrefixMode::parse(prefix_mode)?;
        Ok(PyKvCacheManager {
            inner: KvManager::new(KvManagerConfig {
                num_blocks,
                block_size,
                prefix_mode,
            })?,
        })
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }

    #[getter]
    fn prefix_mode(&self) -> &'static str {
        self.inner.prefix_mode().name()
    }

    #[getter]
    fn num_free_blocks(&self) -> u32 {
        self.inner.num_free_blocks()
    }

    #[getter]
    fn num_requests(&self) -> usize {
        self.inner.num_requests()
    }

    #[getter]
    fn usage(&self) -> f64 {
        self.inner.usage()
    }

    #[pyo3(signature = (tokens, offsets, namespaces = None))]
    fn match_prefix<'py>(
        &mut self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        namespaces: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let offs = counts(offsets, "offsets")?;
        let n = offs.len().saturating_sub(1);
        let (t, sp) = token_spans(Some(tokens), Some(offsets), n)?.expect("both given");
        let ns = self::namespaces(namespaces, n)?;
        let toks = t.slice();
        let inner = &mut self.inner;
        let hits: Vec<i64> = py.detach(|| {
            sp.iter()
                .zip(&ns)
                .map(|(&(s, e), &ns)| {
                    inner
                        .match_prefix(ns, &toks[s..e], (e - s).saturating_sub(1))
                        .num_tokens as i64
                })
                .collect()
        });
        Ok(PyArray1::from_vec(py, hits))
    }

    #[pyo3(signature = (req_ids, num_tokens, tokens = None, offsets = None, namespaces = None, watermark_blocks = 0))]
    #[allow(clippy::too_many_arguments)]
    fn admit<'py>(
        &mut self,
        py: Python<'py>,
        req_ids: &Bound<'py, PyAny>,
        num_tokens: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
        offsets: Option<&Bound<'py, PyAny>>,
        namespaces: Option<&Bound<'py, PyAny>>,
        watermark_blocks: i64,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let reqs = ids(req_ids, "req_ids")?;
        let n = reqs.len();
        let totals = counts(num_tokens, "num_tokens")?;
        same_len("num_tokens", totals.len(), n)?;
        let ts = token_spans(tokens, offsets, n)?;
        let ns = self::namespaces(namespaces, n)?;
        let wm = u32::try_from(watermark_blocks).map_err(|_| {
            invalid(format!(
                "watermark_blocks must be non-negative, got {watermark_blocks}"
            ))
        })?;
        unique(&reqs, KvError::DuplicateRequest)?;
        if let Some(&r) = reqs.iter().find(|&&r| self.inner.contains(r)) {
            return Err(KvError::DuplicateRequest(r).into());
        }
        let max = self.inner.max_tokens();
        for (i, &total) in totals.iter().enumerate() {
            if total == 0 {
                return Err(invalid(format!(
                    "request {}: num_tokens must be at least 1",
                    reqs[i]
                )));
            }
            if total > max {
                return Err(KvError::TooLong(format!(
                    "request {} needs {total} tokens; the pool holds {max}",
                    reqs[i]
                ))
                .into());
            }
            if let Some((_, sp)) = &ts {
                if sp[i].0 == sp[i].1 {
                    return Err(invalid(format!("request {}: empty prompt", reqs[i])));
                }
            }
        }
        let ts = ts.as_ref().map(|(t, sp)| (t.slice(), sp));
        let inner = &mut self.inner;
        let hits: PyResult<Vec<i64>> = py.detach(|| {
            let mut hits = Vec::with_capacity(n);
            let empty = PrefixHit::default();
            for i in 0..n {
                let ok = match &ts {
                    Some((t, sp)) => {
                        let toks = &t[sp[i].0..sp[i].1];
                        let cap = toks.len().min(totals[i]) - 1;
                        let hit = inner.match_prefix(ns[i], toks, cap);
                        let new = totals[i] - hit.num_tokens;
                        let ok = inner.admit(reqs[i], ns[i], toks, &hit, new, wm)?;
                        if ok {
                            hits.push(hit.num_tokens as i64);
                        }
                        ok
                    }
                    None => {
                        let ok = inner.admit(reqs[i], ns[i], &[], &empty, totals[i], wm)?;
                        if ok {
                            hits.push(0);
                        }
                        ok
                    }
                };
                if !ok {
                    break;
                }
            }
            Ok(hits)
        });
        Ok(PyArray1::from_vec(py, hits?))
    }

    fn allocate_slots(
        &mut self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        num_total_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let reqs = ids(req_ids, "req_ids")?;
        let totals = counts(num_total_tokens, "num_total_tokens")?;
        same_len("num_total_tokens", totals.len(), reqs.len())?;
        self.check_live(&reqs)?;
        let max = self.inner.max_tokens();
        if let Some(i) = totals.iter().position(|&t| t > max) {
            return Err(KvError::TooLong(format!(
                "request {} needs {} tokens; the pool holds {max}",
                reqs[i], totals[i]
            ))
            .into());
        }
        let inner = &mut self.inner;
        py.detach(|| {
            for (i, (&r, &t)) in reqs.iter().zip(&totals).enumerate() {
                if !inner.allocate_slots(r, t)? {
                    return Ok(i);
                }
            }
            Ok(reqs.len())
        })
    }

    #[pyo3(signature = (req_ids, tokens, offsets))]
    fn cache_computed(
        &mut self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let reqs = ids(req_ids, "req_ids")?;
        let (t, sp) = token_spans(Some(tokens), Some(offsets), reqs.len())?.expect("both given");
        self.check_live(&reqs)?;
        self.check_computed(&reqs, &sp)?;
        let toks = t.slice();
        let inner = &mut self.inner;
        py.detach(|| {
            for (&r, &(s, e)) in reqs.iter().zip(&sp) {
                inner.cache_computed(r, &toks[s..e])?;
            }
            Ok(())
        })
    }

    #[pyo3(signature = (req_ids, tokens = None, offsets = None))]
    fn free(
        &mut self,
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
        self.check_live(&reqs)?;
        if let Some((_, sp)) = &ts {
            self.check_computed(&reqs, sp)?;
        }
        let ts = ts.as_ref().map(|(t, sp)| (t.slice(), sp));
        let inner = &mut self.inner;
        py.detach(|| {
            for (i, &r) in reqs.iter().enumerate() {
                match &ts {
                    Some((t, sp)) => inner.free(r, &t[sp[i].0..sp[i].1])?,
                    None => inner.free(r, &[])?,
                }
            }
            Ok(())
        })
    }

    fn fork(
        &mut self,
        parent_ids: &Bound<'_, PyAny>,
        child_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let parents = ids(parent_ids, "parent_ids")?;
        let children = ids(child_ids, "child_ids")?;
        same_len("child_ids", children.len(), parents.len())?;
        self.check_live(&parents)?;
        unique(&children, KvError::DuplicateRequest)?;
        if let Some(&c) = children.iter().find(|&&c| self.inner.contains(c)) {
            return Err(KvError::DuplicateRequest(c).into());
        }
        for (&p, &c) in parents.iter().zip(&children) {
            self.inner.fork(p, c)?;
        }
        Ok(())
    }

    fn block_table<'py>(
        &self,
        py: Python<'py>,
        req_id: u64,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let t = self.inner.block_table(req_id)?;
        Ok(PyArray1::from_vec(
            py,
            t.iter().map(|&b| b as i32).collect(),
        ))
    }

    #[pyo3(signature = (req_ids, width = None))]
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        req_ids: &Bound<'py, PyAny>,
        width: Option<usize>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let reqs = ids(req_ids, "req_ids")?;
        self.check_live(&reqs)?;
        let longest = reqs
            .iter()
            .map(|&r| self.inner.block_table(r).map(|t| t.len()).unwrap_or(0))
            .max()
            .unwrap_or(0);
        let w = width.unwrap_or(longest);
        if w < longest {
            return Err(invalid(format!(
                "width {w} is narrower than the longest table ({longest} blocks)"
            )));
        }
        let mut out = vec![0i32; reqs.len() * w];
        for (row, &r) in reqs.iter().enumerate() {
            for (j, &b) in self.inner.block_table(r)?.iter().enumerate() {
                out[row * w + j] = b as i32;
            }
        }
        let arr = PyArray1::from_vec(py, out);
        arr.reshape([reqs.len(), w])
    }

    fn drain_copy_ops<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let mut ops = Vec::new();
        self.inner.drain_copy_ops(&mut ops);
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
        let blocks = i64s(block_ids, "block_ids")?;
        let mut out = Vec::with_capacity(blocks.len());
        for &b in &blocks {
            let id = u32::try_from(b)
                .map_err(|_| KvError::InvalidBlock(format!("block {b} outside the pool")))?;
            out.push(self.inner.ref_count(id)? as i64);
        }
        Ok(PyArray1::from_vec(py, out))
    }

    fn free_queue<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        PyArray1::from_vec(
            py,
            self.inner
                .free_queue()
                .into_iter()
                .map(|b| b as i32)
                .collect(),
        )
    }

    fn block_hash(&self, block_id: i64) -> PyResult<Option<u128>> {
        let id = u32::try_from(block_id)
            .ok()
            .filter(|&b| b < self.inner.num_blocks())
            .ok_or_else(|| KvError::InvalidBlock(format!("block {block_id} outside the pool")))?;
        Ok(self.inner.block_hash(id))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
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

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants()?)
    }

    fn __contains__(&self, req_id: i64) -> bool {
        u64::try_from(req_id).is_ok_and(|r| self.inner.contains(r))
    }

    fn __len__(&self) -> usize {
        self.inner.num_requests()
    }

    fn __repr__(&self) -> String {
        format!(
            "KvCacheManager(num_blocks={}, block_size={}, prefix_mode='{}', num_free_blocks={}, num_requests={})",
            self.inner.num_blocks(),
            self.inner.block_size(),
            self.inner.prefix_mode().name(),
            self.inner.num_free_blocks(),
            self.inner.num_requests()
        )
    }
}
