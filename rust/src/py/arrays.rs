//! Array arguments: 1-D NumPy integer arrays (any integer dtype), sequences of Python ints, or
//! one int (a batch of one, or a value for every request), checked before anything mutates.
//!
//! Large inputs (token arrays) are borrowed without a copy when they are contiguous `uint32`;
//! other integer dtypes and sequences are copied with a range check. Per-request arrays (ids,
//! counts, offsets) are small and copied into `Vec`s. Every failure is an
//! `InvalidArgumentError` naming the argument (never a `TypeError` or `OverflowError`).
//! Built on the scalar parsers of `args`; `args` does not use this file.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::{describe, int64};
use super::errors::invalid;
use crate::kv_manager::MAX_ID;

/// Reads a 1-D NumPy integer array (any integer dtype) as i64; `None` if `obj` is no array.
fn int_array(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Vec<i64>>> {
    macro_rules! read {
        ($t:ty) => {
            if let Ok(a) = obj.cast::<PyArray1<$t>>() {
                let ro = a
                    .try_readonly()
                    .map_err(|e| invalid(format!("{name}: {e}")))?;
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
        let ro = a
            .try_readonly()
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        let v: Option<Vec<i64>> = ro
            .as_array()
            .iter()
            .map(|&x| i64::try_from(x).ok())
            .collect();
        return v
            .map(Some)
            .ok_or_else(|| invalid(format!("{name}: a value is 2**63 or more")));
    }
    if obj.cast::<PyUntypedArray>().is_ok() {
        return Err(invalid(format!(
            "{name} must be a 1-D integer array, got {}",
            describe(obj)
        )));
    }
    Ok(None)
}

/// Integer argument values: one int, or an array / sequence of them.
enum Ints {
    One(i64),
    Many(Vec<i64>),
}

/// Parses an integer array, a sequence of ints or one int (anything with `__index__`).
fn int_values(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Ints> {
    if let Some(v) = int_array(obj, name)? {
        return Ok(Ints::Many(v));
    }
    if obj.hasattr("__index__").unwrap_or(false) {
        return match int64(obj, name)? {
            Some(v) => Ok(Ints::One(v)),
            None => Err(invalid(format!("{name}: the value is outside int64"))),
        };
    }
    obj.extract::<Vec<i64>>().map(Ints::Many).map_err(|_| {
        invalid(format!(
            "{name} must be an int, a 1-D integer array or a sequence of ints, got {}",
            describe(obj)
        ))
    })
}

/// An integer array or a sequence of ints; a lone int is a batch of one when `one` is set.
pub(crate) fn int_batch(obj: &Bound<'_, PyAny>, name: &str, one: bool) -> PyResult<Vec<i64>> {
    match int_values(obj, name)? {
        Ints::Many(v) => Ok(v),
        Ints::One(x) if one => Ok(vec![x]),
        Ints::One(_) => Err(invalid(format!(
            "{name} must be a 1-D integer array or a sequence of ints, got {}",
            describe(obj)
        ))),
    }
}

/// An integer array or a sequence of ints (no lone int).
pub(crate) fn ints(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    int_batch(obj, name, false)
}

/// Like `ints`, but a lone int is repeated `len` times; `None` gives `default`.
pub(crate) fn ints_or_scalar(
    obj: Option<&Bound<'_, PyAny>>,
    len: usize,
    default: i64,
    name: &str,
) -> PyResult<Vec<i64>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(vec![default; len]);
    };
    match int_values(obj, name)? {
        Ints::One(x) => Ok(vec![x; len]),
        Ints::Many(v) if v.len() == len => Ok(v),
        Ints::Many(v) => Err(invalid(format!(
            "{name} has {} entries for {len} requests",
            v.len()
        ))),
    }
}

/// Converts with a range check into `T` (u32, i32, u64...), naming the argument on failure.
pub(crate) fn conv<T: TryFrom<i64>>(v: i64, name: &str) -> PyResult<T> {
    T::try_from(v).map_err(|_| invalid(format!("{name}: value {v} out of range")))
}

/// `conv` over a slice.
pub(crate) fn conv_all<T: TryFrom<i64>>(v: &[i64], name: &str) -> PyResult<Vec<T>> {
    v.iter().map(|&x| conv(x, name)).collect()
}

/// Token ids: borrowed from a contiguous `uint32` array, or copied.
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

/// Token ids in `0..2**32`: a 1-D integer array, a sequence of ints or one int.
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
    let v = int_batch(obj, name, true)?;
    match v.iter().find(|&&t| u32::try_from(t).is_err()) {
        Some(t) => Err(invalid(format!(
            "{name}: token ids must be in 0..2**32, got {t}"
        ))),
        None => Ok(Tokens::Owned(v.into_iter().map(|t| t as u32).collect())),
    }
}

/// Request ids or namespaces (each in `0..2**63`): an integer array, a sequence or one int.
pub(crate) fn ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u64>> {
    non_negative(int_batch(obj, name, true)?, name, MAX_ID as i64)
}

/// Non-negative counts or offsets: an integer array, a sequence or one int.
pub(crate) fn counts(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    non_negative(int_batch(obj, name, true)?, name, i64::MAX)
}

/// Like `counts`, but a lone int is repeated for each of `len` requests.
pub(crate) fn counts_for(obj: &Bound<'_, PyAny>, name: &str, len: usize) -> PyResult<Vec<usize>> {
    let v = ints_or_scalar(Some(obj), len, 0, name)?;
    non_negative(v, name, i64::MAX)
}

/// Like `ids`, but a lone int is repeated for each of `len` requests; `None`: all 0.
pub(crate) fn ids_for(
    obj: Option<&Bound<'_, PyAny>>,
    name: &str,
    len: usize,
) -> PyResult<Vec<u64>> {
    non_negative(ints_or_scalar(obj, len, 0, name)?, name, MAX_ID as i64)
}

fn non_negative<T: TryFrom<i64>>(v: Vec<i64>, name: &str, hi: i64) -> PyResult<Vec<T>> {
    v.into_iter()
        .map(|x| {
            if (0..=hi).contains(&x) {
                T::try_from(x).map_err(|_| invalid(format!("{name}: {x} out of range")))
            } else {
                Err(invalid(format!(
                    "{name}: values must be in 0..={hi}, got {x}"
                )))
            }
        })
        .collect()
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
