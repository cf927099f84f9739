//! Maps `KvError` to the Python exception hierarchy rooted at `KvCoreError`.
//!
//! One class per variant, all subclasses of `KvCoreError` (itself an `Exception`), so callers can
//! catch the family or one case. This is the only place the mapping lives; `invalid` is the
//! shorthand the argument parsers (`args`, `arrays`, ...) raise with.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::error::KvError;

create_exception!(
    kvcore._kvcore,
    KvCoreError,
    PyException,
    "Base class of every kvcore error."
);
create_exception!(
    kvcore._kvcore,
    InvalidArgumentError,
    KvCoreError,
    "A malformed argument."
);
create_exception!(
    kvcore._kvcore,
    UnknownRequestError,
    KvCoreError,
    "An unknown request id."
);
create_exception!(
    kvcore._kvcore,
    DuplicateRequestError,
    KvCoreError,
    "A request id already in use."
);
create_exception!(
    kvcore._kvcore,
    InvalidBlockError,
    KvCoreError,
    "A block id out of range or the null block."
);
create_exception!(
    kvcore._kvcore,
    DoubleFreeError,
    KvCoreError,
    "Freeing what holds no reference."
);
create_exception!(
    kvcore._kvcore,
    StaleStepError,
    KvCoreError,
    "An update for a step that is not outstanding."
);
create_exception!(
    kvcore._kvcore,
    TooLongError,
    KvCoreError,
    "An input longer than the cache or model can hold."
);
create_exception!(
    kvcore._kvcore,
    InvariantError,
    KvCoreError,
    "Corrupted internal state (a bug)."
);

/// An `InvalidArgumentError` with `msg`.
pub(crate) fn invalid(msg: String) -> PyErr {
    KvError::InvalidArgument(msg).into()
}

impl From<KvError> for PyErr {
    fn from(e: KvError) -> PyErr {
        let msg = e.to_string();
        match e {
            KvError::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
            KvError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            KvError::DuplicateRequest(_) => DuplicateRequestError::new_err(msg),
            KvError::InvalidBlock(_) => InvalidBlockError::new_err(msg),
            KvError::DoubleFree(_) => DoubleFreeError::new_err(msg),
            KvError::StaleStep { .. } | KvError::NoStepOutstanding { .. } => {
                StaleStepError::new_err(msg)
            }
            KvError::TooLong(_) => TooLongError::new_err(msg),
            KvError::Invariant(_) => InvariantError::new_err(msg),
        }
    }
}

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvCoreError", py.get_type::<KvCoreError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add(
        "DuplicateRequestError",
        py.get_type::<DuplicateRequestError>(),
    )?;
    m.add("InvalidBlockError", py.get_type::<InvalidBlockError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("StaleStepError", py.get_type::<StaleStepError>())?;
    m.add("TooLongError", py.get_type::<TooLongError>())?;
    m.add("InvariantError", py.get_type::<InvariantError>())?;
    Ok(())
}
