//! `Shared<T>`: the Rust state of a Python object behind a mutex, so one object can be used
//! from several threads.
//!
//! Each call runs under the lock and is atomic. A call that finds the lock taken (another
//! thread's call is running, its GIL released for the heavy part) waits for it with the GIL
//! released, so the two threads cannot deadlock on lock and GIL. The work closure is `Send`:
//! it cannot touch a Python object, so no Python code (a finalizer, a callback) ever runs
//! while the lock is held and a call cannot re-enter the same object. Arguments are parsed
//! before the lock is taken and results become Python objects after it is released. A panic
//! under the lock (a bug) poisons it: later calls raise `InvariantError`.

use std::sync::{Mutex, TryLockError};

use pyo3::prelude::*;

use crate::error::KvError;

/// A mutex-guarded value shared by the threads that hold its Python object.
pub(crate) struct Shared<T>(Mutex<T>);

fn poisoned() -> PyErr {
    KvError::Invariant(
        "an earlier call panicked while holding this object (a bug): its state is unreliable"
            .into(),
    )
    .into()
}

impl<T: Send> Shared<T> {
    pub(crate) fn new(value: T) -> Self {
        Shared(Mutex::new(value))
    }

    /// Runs `f` on the state; the GIL stays held unless the lock must be waited for. For quick
    /// calls.
    pub(crate) fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut T) -> R + Send,
    ) -> PyResult<R> {
        self.run(py, false, f)
    }

    /// Runs `f` on the state with the GIL released (heavy calls).
    pub(crate) fn detached<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut T) -> R + Send,
    ) -> PyResult<R> {
        self.run(py, true, f)
    }

    fn run<R: Send>(
        &self,
        py: Python<'_>,
        detach: bool,
        f: impl FnOnce(&mut T) -> R + Send,
    ) -> PyResult<R> {
        match self.0.try_lock() {
            Ok(mut guard) => {
                let state: &mut T = &mut guard;
                Ok(if detach {
                    py.detach(|| f(state))
                } else {
                    f(state)
                })
            }
            Err(TryLockError::WouldBlock) => py
                .detach(|| self.0.lock().map(|mut guard| f(&mut guard)).ok())
                .ok_or_else(poisoned),
            Err(TryLockError::Poisoned(_)) => Err(poisoned()),
        }
    }
}
