//! Python side of the tier moves: `TierPlan` (the I/O half of a StepPlan's tier ops) and the
//! scheduler's tier arguments.
//!
//! The copy pairs (`StepPlan.tier_offload`, `StepPlan.tier_load`) sit on the StepPlan beside
//! `copy_ops`; the keys, token ids and fetch lists the background I/O needs sit here. Every array
//! is a Rust vector handed to NumPy without a copy. Shapes are documented in `_kvcore.pyi`.

use numpy::ndarray::Array2;
use numpy::{PyArray1, PyArray2};
use pyo3::prelude::*;

use super::errors::invalid;
use crate::error::KvError;
use crate::tiers::{BlockKey, Preemption, TierConfig, TierOps};

pub(crate) fn pairs(py: Python<'_>, v: &[[u32; 2]]) -> PyResult<Py<PyArray2<i32>>> {
    let flat: Vec<i32> = v.iter().flat_map(|p| [p[0] as i32, p[1] as i32]).collect();
    mat(py, flat, v.len(), 2)
}

fn mat<T: numpy::Element>(
    py: Python<'_>,
    v: Vec<T>,
    rows: usize,
    cols: usize,
) -> PyResult<Py<PyArray2<T>>> {
    let a = Array2::from_shape_vec((rows, cols), v)
        .map_err(|e| KvError::Invariant(format!("array shape: {e}")))?;
    Ok(PyArray2::from_owned_array(py, a).unbind())
}

fn keys(py: Python<'_>, k: &[BlockKey]) -> PyResult<Py<PyArray2<u8>>> {
    mat(py, k.concat(), k.len(), 32)
}

fn toks(py: Python<'_>, t: &[u32], rows: usize, bs: usize) -> PyResult<Py<PyArray2<i32>>> {
    mat(py, t.iter().map(|&x| x as i32).collect(), rows, bs)
}

/// Keys, token ids and fetch lists of one step's tier moves (documented in `_kvcore.pyi`).
#[pyclass(name = "TierPlan", module = "kvcore._kvcore", frozen, get_all)]
pub struct PyTierPlan {
    offload_kind: Py<PyArray1<u8>>,
    offload_keys: Py<PyArray2<u8>>,
    offload_tokens: Py<PyArray2<i32>>,
    publish: Py<PyArray1<i32>>,
    publish_keys: Py<PyArray2<u8>>,
    publish_tokens: Py<PyArray2<i32>>,
    fetch_seqs: Py<PyArray1<i64>>,
    fetch_offsets: Py<PyArray1<i32>>,
    fetch_keys: Py<PyArray2<u8>>,
    fetch_tokens: Py<PyArray2<i32>>,
}

impl PyTierPlan {
    pub(crate) fn new(py: Python<'_>, t: TierOps, bs: usize) -> PyResult<Self> {
        let offsets = if t.fetch_offsets.is_empty() {
            vec![0]
        } else {
            t.fetch_offsets
        };
        Ok(PyTierPlan {
            offload_kind: PyArray1::from_vec(py, t.offload_kind).unbind(),
            offload_keys: keys(py, &t.offload_keys)?,
            offload_tokens: toks(py, &t.offload_tokens, t.offload.len(), bs)?,
            publish: PyArray1::from_vec(py, t.publish.iter().map(|&b| b as i32).collect()).unbind(),
            publish_keys: keys(py, &t.publish_keys)?,
            publish_tokens: toks(py, &t.publish_tokens, t.publish.len(), bs)?,
            fetch_seqs: PyArray1::from_vec(py, t.fetch_seqs.iter().map(|&s| s as i64).collect())
                .unbind(),
            fetch_offsets: PyArray1::from_vec(py, offsets.iter().map(|&o| o as i32).collect())
                .unbind(),
            fetch_keys: keys(py, &t.fetch_keys)?,
            fetch_tokens: toks(py, &t.fetch_tokens, t.fetch_keys.len(), bs)?,
        })
    }
}

#[pymethods]
impl PyTierPlan {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "TierPlan(offloads={}, publish={}, fetch_seqs={})",
            self.offload_kind.bind(py).len().unwrap_or(0),
            self.publish.bind(py).len().unwrap_or(0),
            self.fetch_seqs.bind(py).len().unwrap_or(0)
        )
    }
}

/// The scheduler's tier configuration from its Python arguments (None: tiers off).
pub(crate) fn tier_config(
    host_blocks: i64,
    tier_fetch: bool,
    tier_publish: bool,
    tier_root: Option<Vec<u8>>,
    bytes_per_block: i64,
    preemption: &str,
) -> PyResult<Option<TierConfig>> {
    let mode = Preemption::parse(preemption)?;
    let host = u32::try_from(host_blocks).map_err(|_| {
        invalid(format!(
            "host_blocks must be in [0, 2^32), got {host_blocks}"
        ))
    })?;
    if host == 0 {
        if tier_fetch || tier_publish || mode != Preemption::Recompute {
            return Err(invalid(
                "disk/remote tiers and swap preemption need an L2 host tier (host_blocks > 0)"
                    .into(),
            ));
        }
        return Ok(None);
    }
    let root: BlockKey = match tier_root {
        None => [0; 32],
        Some(r) => r.try_into().map_err(|r: Vec<u8>| {
            invalid(format!("tier_root must be 32 bytes, got {}", r.len()))
        })?,
    };
    if bytes_per_block < 1 {
        return Err(invalid(format!(
            "bytes_per_block must be >= 1, got {bytes_per_block}"
        )));
    }
    let mut c = TierConfig::new(host);
    (c.fetch, c.publish, c.root, c.preemption) = (tier_fetch, tier_publish, root, mode);
    c.bytes_per_block = bytes_per_block as u64;
    Ok(Some(c))
}
