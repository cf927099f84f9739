//! Argument parsing for the scheduler binding: integer arrays or int sequences, scalars
//! broadcast over a batch, flat values split by offsets, and the sampled-token array.
//!
//! Every check happens here, before the scheduler is called, and every failure is an
//! `InvalidArgumentError` naming the argument (never an `OverflowError` or a panic). Per-request
//! arrays are small and copied; the sampled tokens (one per sample) are read in one pass.

use numpy::prelude::*;
use numpy::{PyArray1, PyUntypedArray};
use pyo3::prelude::*;

use super::arrays::invalid;

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
pub(crate) fn ints(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
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
pub(crate) fn ints_or_scalar(
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
pub(crate) fn conv<T: TryFrom<i64>>(v: i64, name: &str) -> PyResult<T> {
    T::try_from(v).map_err(|_| invalid(format!("{name}: value {v} out of range")))
}

/// `conv` over a slice.
pub(crate) fn conv_all<T: TryFrom<i64>>(v: &[i64], name: &str) -> PyResult<Vec<T>> {
    v.iter().map(|&x| conv(x, name)).collect()
}

/// Splits `flat` by `offsets` ([k + 1], starting at 0, non-decreasing, ending at len).
pub(crate) fn split(
    flat: &[u32],
    offsets: &[i64],
    k: usize,
    name: &str,
) -> PyResult<Vec<Vec<u32>>> {
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

/// The sampled tokens: a 1-D int32 or int64 NumPy array of token ids in `[0, 2**32)`.
pub(crate) fn sampled_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
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
