//! The PyO3 module `kvcore._kvcore`: the only folder of the crate that mentions pyo3.
//!
//! Each wrapper type is named `PyX` here and exposed as `X` in Python. Calls are batched:
//! ids and counts cross as NumPy arrays, never as per-block Python objects.

use pyo3::prelude::*;

pub(crate) mod arrays;
pub(crate) mod errors;
mod manager;
mod sched_args;
mod scheduler;
mod step_output;
mod tiers;

#[pymodule]
fn _kvcore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    errors::register(m)?;
    m.add_class::<manager::PyKvCacheManager>()?;
    scheduler::register(m)?;
    Ok(())
}
