//! Scalar arguments: Python ints, strings, bools and floats checked by hand, so a bad value
//! raises `InvalidArgumentError` naming the argument, never PyO3's `TypeError` or
//! `OverflowError` (a parameter typed `i64` would raise those before the method runs).
//!
//! An int is anything with `__index__` (Python and NumPy integers) except a bool; a value
//! outside the target range is refused with the range in the message.
//!
//! Layering: `errors` ← `args` ← `arrays` ← the classes. This file uses only `errors`;
//! `arrays` builds on it (`int64`, `describe`), never the other way round.

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyString};

use super::errors::invalid;
use crate::kv_manager::MAX_ID;

/// Describes what `obj` is, for error messages.
pub(crate) fn describe(obj: &Bound<'_, PyAny>) -> String {
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

/// A short `repr` of `obj` for messages (huge ints are cut).
fn short_repr(obj: &Bound<'_, PyAny>) -> String {
    let r = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    if r.chars().count() > 40 {
        format!("{}...", r.chars().take(37).collect::<String>())
    } else {
        r
    }
}

/// `Some(i64)` for an int in the `int64` range, `None` for an int outside it; Err if `obj`
/// is no int.
pub(crate) fn int64(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<i64>> {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return Err(invalid(format!(
            "{name} must be an int, got {}",
            describe(obj)
        )));
    }
    match obj.extract::<i64>() {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => Ok(None),
        Err(_) => Err(invalid(format!(
            "{name} must be an int, got {}",
            describe(obj)
        ))),
    }
}

/// `v` as written in messages: powers of two as `2**k - 1` / `-2**k`.
fn bound(v: i64) -> String {
    match v {
        i64::MAX => "2**63 - 1".into(),
        i64::MIN => "-2**63".into(),
        _ if v > 1 << 20 && (v + 1).count_ones() == 1 => {
            format!("2**{} - 1", (v + 1).trailing_zeros())
        }
        _ if v < -(1 << 20) && v.unsigned_abs().count_ones() == 1 => {
            format!("-2**{}", v.unsigned_abs().trailing_zeros())
        }
        _ => v.to_string(),
    }
}

/// An int in `lo..=hi`, converted to `T`.
pub(crate) fn int_in<T: TryFrom<i64>>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    lo: i64,
    hi: i64,
) -> PyResult<T> {
    match int64(obj, name)? {
        Some(v) if (lo..=hi).contains(&v) => T::try_from(v).map_err(|_| {
            invalid(format!(
                "{name} must be in {}..={}, got {v}",
                bound(lo),
                bound(hi)
            ))
        }),
        _ => Err(invalid(format!(
            "{name} must be an int in {}..={}, got {}",
            bound(lo),
            bound(hi),
            short_repr(obj)
        ))),
    }
}

/// A non-negative int up to `hi`, converted to `T` (u32, usize...).
pub(crate) fn count<T: TryFrom<i64>>(obj: &Bound<'_, PyAny>, name: &str, hi: i64) -> PyResult<T> {
    int_in(obj, name, 0, hi)
}

/// A request id or namespace: an int in `0..2**63`.
pub(crate) fn id(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    int_in(obj, name, 0, MAX_ID as i64)
}

/// A `str`.
pub(crate) fn text(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    match obj.cast::<PyString>() {
        Ok(s) => Ok(s.to_string()),
        Err(_) => Err(invalid(format!(
            "{name} must be a str, got {}",
            describe(obj)
        ))),
    }
}

/// A `bool` (Python or NumPy).
pub(crate) fn flag(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    obj.extract::<bool>()
        .map_err(|_| invalid(format!("{name} must be a bool, got {}", describe(obj))))
}

/// A real number (int or float, NaN refused).
pub(crate) fn real(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{name} must be a number, got a bool")));
    }
    match obj.extract::<f64>() {
        Ok(v) if !v.is_nan() => Ok(v),
        _ => Err(invalid(format!(
            "{name} must be a number, got {}",
            short_repr(obj)
        ))),
    }
}

/// `obj` or, when absent (`None`), `default`, through `parse`.
pub(crate) fn or_default<T>(
    obj: Option<&Bound<'_, PyAny>>,
    default: T,
    parse: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<T> {
    match obj {
        Some(o) if !o.is_none() => parse(o),
        _ => Ok(default),
    }
}
