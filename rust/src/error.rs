//! The one error type of the core, `KvError`, and its `Result` alias.
//!
//! Every fallible public call returns `KvResult<T>`. A call that returns `Err` has changed
//! nothing (validate first, then mutate). `py/errors.rs` maps each variant to one Python
//! exception class of the `KvCoreError` hierarchy; add a variant there when you add one here.

use std::fmt;

/// Everything that can go wrong because of the caller's input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvError {
    /// A malformed argument: zero or negative size, empty input, wrong length, bad config.
    InvalidArgument(String),
    /// A request id the structure does not know.
    UnknownRequest(u64),
    /// A request id that is already in use.
    DuplicateRequest(u64),
    /// A block id outside the pool, or the null block where a real one is needed.
    InvalidBlock(String),
    /// Freeing something that holds no reference.
    DoubleFree(String),
    /// A step id that is not the one outstanding (stale or repeated `update`).
    StaleStep { expected: u64, got: u64 },
    /// An `update` when no step is outstanding (already updated, or never scheduled).
    NoStepOutstanding { got: u64 },
    /// An input longer than what the cache or the model can ever hold.
    TooLong(String),
    /// `check_invariants()` found corrupted state (a bug, reported rather than panicking).
    Invariant(String),
}

/// Result alias used across the crate.
pub type KvResult<T> = Result<T, KvError>;

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvError::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            KvError::UnknownRequest(id) => write!(f, "unknown request id {id}"),
            KvError::DuplicateRequest(id) => write!(f, "request id {id} is already in use"),
            KvError::InvalidBlock(m) => write!(f, "invalid block: {m}"),
            KvError::DoubleFree(m) => write!(f, "double free: {m}"),
            KvError::StaleStep { expected, got } => {
                write!(f, "stale step id {got}: the outstanding step is {expected}")
            }
            KvError::NoStepOutstanding { got } => {
                write!(
                    f,
                    "stale step id {got}: no step is outstanding (update already applied?)"
                )
            }
            KvError::TooLong(m) => write!(f, "too long: {m}"),
            KvError::Invariant(m) => write!(f, "invariant violated: {m}"),
        }
    }
}

impl std::error::Error for KvError {}
