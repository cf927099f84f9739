//! Argument parsing for the scheduler binding: flat values split by offsets and the
//! sampled-token array (integer arrays and scalars are read by `arrays` and `args`).
//!
//! Every check happens here, before the scheduler is called, and every failure is an
//! `InvalidArgumentError` naming the argument (never an `OverflowError` or a panic). Per-request
//! arrays are small and copied; the sampled tokens (one per sample) are read in one pass.

use numpy::prelude::*;
use numpy::{PyArray1, PyUntypedArray};
use pyo3::prelude::*;

use super::errors::invalid;

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
        let ro = a
            .try_readonly()
            .map_err(|e| invalid(format!("sampled_token_ids: {e}")))?;
        let arr = ro.as_array();
        let mut out = Vec::with_capacity(arr.len());
        for (i, &v) in arr.iter().enumerate() {
            out.push(u32::try_from(v).map_err(|_| bad(i, i64::from(v)))?);
        }
        return Ok(out);
    }
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        let ro = a
            .try_readonly()
            .map_err(|e| invalid(format!("sampled_token_ids: {e}")))?;
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
