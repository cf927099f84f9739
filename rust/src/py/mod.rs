//! The PyO3 module `kvcore._kvcore`: the only folder of the crate that mentions pyo3.
//!
//! Each wrapper type is named `PyX` here and exposed as `X` in Python. Calls are batched:
//! ids and counts cross as NumPy arrays (or int sequences), never as per-block Python objects.
//! Every argument is parsed by hand (`args` for scalars, `arrays` on top of it), so bad input
//! raises a `KvCoreError` subclass, never `TypeError`/`OverflowError`; the stateful classes
//! sit behind a lock (`lock`) and are safe to share between threads.

use pyo3::prelude::*;

pub(crate) mod args;
pub(crate) mod arrays;
pub(crate) mod errors;
mod lock;
mod manager;
mod manager_args;
mod rows;
mod sched_args;
mod scheduler;
mod snapshot;
mod step_output;
mod tiers;

#[pymodule]
fn _kvcore(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEBUG_BUILD", cfg!(debug_assertions))?;
    errors::register(m)?;
    m.add_class::<manager::PyKvCacheManager>()?;
    scheduler::register(m)?;
    m.add_function(wrap_pyfunction!(rows::copy_block_rows, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot::kv_snapshot, m)?)?;
    Ok(())
}
