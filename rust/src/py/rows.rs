//! `copy_block_rows`: the CPU byte copy of tier moves (L2 loads and offloads), one pass per row
//! with the GIL released. Arguments are NumPy views of the torch tensors (no copy): lists of
//! C-contiguous 2-D `uint8` arrays (one per layer) and an `[n, 2]` integer array of
//! (source row, destination row) pairs. Bad input is an `InvalidArgumentError`, nothing copied.

use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::describe;
use super::errors::invalid;
use crate::tiers;

fn layers<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Vec<Bound<'py, PyArray2<u8>>>> {
    let it = obj
        .try_iter()
        .map_err(|_| invalid(format!("{name} must be a list of 2-D uint8 arrays")))?;
    it.map(|a| {
        let a = a?;
        a.cast::<PyArray2<u8>>().cloned().map_err(|_| {
            invalid(format!(
                "{name} must hold 2-D uint8 arrays, got {}",
                describe(&a)
            ))
        })
    })
    .collect()
}

fn pair_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<[u32; 2]>> {
    let flat: Vec<i64> = if let Ok(a) = obj.cast::<PyArray2<i32>>() {
        check_pairs_shape(a.shape())?;
        let a = a
            .try_readonly()
            .map_err(|e| invalid(format!("pairs: {e}")))?;
        a.as_array().iter().map(|&x| x as i64).collect()
    } else if let Ok(a) = obj.cast::<PyArray2<i64>>() {
        check_pairs_shape(a.shape())?;
        let a = a
            .try_readonly()
            .map_err(|e| invalid(format!("pairs: {e}")))?;
        a.as_array().iter().copied().collect()
    } else {
        return Err(invalid(format!(
            "pairs must be an [n, 2] int32 or int64 array, got {}",
            describe(obj)
        )));
    };
    flat.chunks_exact(2)
        .map(|p| match (u32::try_from(p[0]), u32::try_from(p[1])) {
            (Ok(a), Ok(b)) => Ok([a, b]),
            _ => Err(invalid(format!("pairs: row index {p:?} out of range"))),
        })
        .collect()
}

fn check_pairs_shape(shape: &[usize]) -> PyResult<()> {
    match shape {
        [_, 2] => Ok(()),
        _ => Err(invalid(format!("pairs must be [n, 2], got {shape:?}"))),
    }
}

/// Copies row `p[0]` of `src[l]` to row `p[1]` of `dst[l]` for every pair `p` and layer `l`
/// (see `kvcore._kvcore.copy_block_rows` in `_kvcore.pyi`).
#[pyfunction]
#[pyo3(signature = (dst, src, pairs, threads = 1))]
pub(crate) fn copy_block_rows(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    pairs: &Bound<'_, PyAny>,
    threads: i64,
) -> PyResult<()> {
    let pairs = pair_list(pairs)?;
    let (dst, src) = (layers(dst, "dst")?, layers(src, "src")?);
    let mut rows = Vec::with_capacity(dst.len());
    for (d, s) in dst.iter().zip(&src) {
        let (ds, ss) = (d.shape(), s.shape());
        if ds[1] != ss[1] {
            return Err(invalid(format!(
                "copy_block_rows: row widths differ ({} vs {} bytes)",
                ds[1], ss[1]
            )));
        }
        rows.push(ds[1]);
    }
    let mut wr: Vec<PyReadwriteArray2<'_, u8>> = Vec::with_capacity(dst.len());
    for d in &dst {
        wr.push(
            d.try_readwrite()
                .map_err(|e| invalid(format!("dst: {e}")))?,
        );
    }
    let mut ro: Vec<PyReadonlyArray2<'_, u8>> = Vec::with_capacity(src.len());
    for s in &src {
        ro.push(s.try_readonly().map_err(|e| invalid(format!("src: {e}")))?);
    }
    let not_contig = |n: &str| invalid(format!("{n} arrays must be C-contiguous"));
    let mut ds: Vec<&mut [u8]> = Vec::with_capacity(wr.len());
    for w in wr.iter_mut() {
        ds.push(w.as_slice_mut().map_err(|_| not_contig("dst"))?);
    }
    let ss: Vec<&[u8]> = ro
        .iter()
        .map(|r| r.as_slice().map_err(|_| not_contig("src")))
        .collect::<PyResult<_>>()?;
    let threads = threads.clamp(1, 64) as usize;
    py.detach(|| tiers::copy_block_rows(ds, &ss, &rows, &pairs, threads))?;
    Ok(())
}
