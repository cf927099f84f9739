//! NumPy argument checking for the batch API: dtype, shape and range, before anything mutates.
//!
//! Large inputs (token arrays) are borrowed without a copy when they are contiguous `uint32`;
//! `int32` tokens are checked for negatives and copied. Per-request arrays (ids, counts,
//! offsets) are small and copied into `Vec`s. Every failure is an `InvalidArgumentError`.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::error::KvError;

/// An `InvalidArgumentError` with `msg`.
pub(crate) fn invalid(msg: String) -> PyErr {
    KvError::InvalidArgument(msg).into()
}

/// Describes what `obj` is, for error messages.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(a) => format!(
            "a {}-D array of dtype {}",
            a.ndim(),
            a.dtype().str().map(|s| s.to_string()).unwrap_or_default()
        ),
        Err(_) => format!(
            "an object of type {}",
            obj.get_type()
                .name()
                .map(|s| s.to_string())
                .unwrap_or_default()
        ),
    }
}

/// Token ids: borrowed from a contiguous `uint32` array, or copied from `int32`.
pub(crate) enum Tokens<'py> {
    Borrowed(PyReadonlyArray1<'py, u32>),
    Owned(Vec<u32>),
}

impl Tokens<'_> {
    /// The tokens as one flat slice.
    pub(crate) fn slice(&self) -> &[u32] {
        match self {
            Tokens::Borrowed(a) => a.as_slice().expect("contiguity checked in tokens()"),
            Tokens::Owned(v) => v,
        }
    }
}

/// Parses a 1-D `uint32` or `int32` array of token ids.
pub(crate) fn tokens<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Tokens<'py>> {
    if let Ok(a) = obj.cast::<PyArray1<u32>>() {
        let r = a
            .try_readonly()
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        if r.as_slice().is_ok() {
            return Ok(Tokens::Borrowed(r));
        }
        return Ok(Tokens::Owned(r.as_array().iter().copied().collect()));
    }
    if let Ok(a) = obj.cast::<PyArray1<i32>>() {
        let r = a
            .try_readonly()
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        let mut out = Vec::with_capacity(r.len());
        for &t in r.as_array().iter() {
            if t < 0 {
                return Err(invalid(format!(
                    "{name}: token ids must be non-negative, got {t}"
                )));
            }
            out.push(t as u32);
        }
        return Ok(Tokens::Owned(out));
    }
    Err(invalid(format!(
        "{name} must be a 1-D uint32 or int32 array, got {}",
        describe(obj)
    )))
}

/// Parses a 1-D `int64` or `uint64` array of ids (non-negative).
pub(crate) fn ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    if let Ok(a) = obj.cast::<PyArray1<u64>>() {
        let r = a
            .try_readonly()
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        return Ok(r.as_array().iter().copied().collect());
    }
    if let Some(v) = non_negative_i64s(obj, name, "ids")? {
        return Ok(v);
    }
    Err(invalid(format!(
        "{name} must be a 1-D int64 or uint64 array, got {}",
        describe(obj)
    )))
}

/// Parses a 1-D `int64` array as is.
pub(crate) fn i64s(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let r = a
            .try_readonly()
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        return Ok(r.as_array().iter().copied().collect());
    }
    Err(invalid(format!(
        "{name} must be a 1-D int64 array, got {}",
        describe(obj)
    )))
}

/// Parses a 1-D `int64` array of non-negative counts or offsets.
pub(crate) fn counts(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    if let Some(v) = non_negative_i64s(obj, name, "values")? {
        return Ok(v);
    }
    Err(invalid(format!(
        "{name} must be a 1-D int64 array, got {}",
        describe(obj)
    )))
}

/// A 1-D `int64` array converted to `T` (`None`: not such an array); a negative entry is an
/// error naming `what` it holds.
fn non_negative_i64s<T: TryFrom<i64>>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    what: &str,
) -> PyResult<Option<Vec<T>>> {
    let Ok(a) = obj.cast::<PyArray1<i64>>() else {
        return Ok(None);
    };
    let r = a
        .try_readonly()
        .map_err(|e| invalid(format!("{name}: {e}")))?;
    r.as_array()
        .iter()
        .map(|&x| {
            T::try_from(x)
                .map_err(|_| invalid(format!("{name}: {what} must be non-negative, got {x}")))
        })
        .collect::<PyResult<Vec<T>>>()
        .map(Some)
}

/// Checks `offsets` (`n + 1` non-decreasing values from 0 to `total`) and returns the spans.
pub(crate) fn spans(offsets: &[usize], n: usize, total: usize) -> PyResult<Vec<(usize, usize)>> {
    if offsets.len() != n + 1 {
        return Err(invalid(format!(
            "offsets must have {} entries (one per request + 1), got {}",
            n + 1,
            offsets.len()
        )));
    }
    if offsets[0] != 0 || offsets[n] != total {
        return Err(invalid(format!(
            "offsets must start at 0 and end at len(tokens) = {total}, got {} .. {}",
            offsets[0], offsets[n]
        )));
    }
    let mut out = Vec::with_capacity(n);
    for w in offsets.windows(2) {
        if w[1] < w[0] {
            return Err(invalid(format!(
                "offsets must be non-decreasing, got {} then {}",
                w[0], w[1]
            )));
        }
        out.push((w[0], w[1]));
    }
    Ok(out)
}

/// Checks that a per-request array has one entry per request.
pub(crate) fn same_len(name: &str, len: usize, n: usize) -> PyResult<()> {
    if len != n {
        return Err(invalid(format!(
            "{name} has {len} entries but there are {n} requests"
        )));
    }
    Ok(())
}
