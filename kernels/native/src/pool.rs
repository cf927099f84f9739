//! Running a kernel's tasks on threads, three ways (chosen per call, measured in docs/kernels.md):
//!
//! * `Omp`: on torch's own OpenMP team. `lib.rs` is handed the address of `GOMP_parallel` from
//!   the libgomp torch loaded, and calls it like a `#pragma omp parallel` region would: the same
//!   worker threads that just ran a torch matmul (and are still spinning, waiting for the next
//!   region) run the tasks, so no second set of threads competes with them for the cores.
//! * `Rayon`: a rayon pool per thread count, built once.
//! * `Single`: the calling thread.
//!
//! Tasks are claimed from one atomic counter (dynamic scheduling: the caller orders them
//! longest first). Nothing is allocated per call in `Omp` and `Single` modes.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Which threads run a call's tasks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Single,
    Omp,
    Rayon,
}

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, u32, u32);

static GOMP_PARALLEL: AtomicUsize = AtomicUsize::new(0);

/// Record the address of libgomp's `GOMP_parallel` (0 forgets it: `Omp` then runs `Rayon`).
pub fn set_gomp_parallel(addr: usize) {
    GOMP_PARALLEL.store(addr, Ordering::Release);
}

/// Whether `Omp` mode has a `GOMP_parallel` to call.
pub fn has_gomp() -> bool {
    GOMP_PARALLEL.load(Ordering::Acquire) != 0
}

struct Region<'a> {
    next: AtomicUsize,
    n: usize,
    panicked: AtomicBool,
    f: &'a (dyn Fn(usize) + Sync),
}

impl Region<'_> {
    fn drain(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
        }
    }
}

extern "C" fn omp_body(data: *mut c_void) {
    // SAFETY: `data` is the `Region` `for_each` passed, alive until GOMP_parallel returns.
    let region = unsafe { &*(data as *const Region) };
    region.drain();
}

fn rayon_pool(threads: usize) -> Arc<rayon::ThreadPool> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    pools
        .entry(threads)
        .or_insert_with(|| {
            Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("kvcore-native-{i}"))
                    .build()
                    .expect("rayon pool"),
            )
        })
        .clone()
}

/// Run `f(0) .. f(n - 1)` on up to `threads` threads; `Err` if a task panicked.
pub fn for_each(
    n: usize,
    threads: usize,
    mode: Mode,
    f: &(dyn Fn(usize) + Sync),
) -> Result<(), ()> {
    let threads = threads.clamp(1, n.max(1));
    let region = Region {
        next: AtomicUsize::new(0),
        n,
        panicked: AtomicBool::new(false),
        f,
    };
    let gomp = GOMP_PARALLEL.load(Ordering::Acquire);
    match mode {
        _ if threads == 1 || n <= 1 => region.drain(),
        Mode::Single => region.drain(),
        Mode::Omp if gomp != 0 => {
            // SAFETY: the address is libgomp's GOMP_parallel (set by the Python wrapper), whose
            // C signature is (fn(void*), void*, unsigned num_threads, unsigned flags).
            let call: GompParallel = unsafe { std::mem::transmute::<usize, GompParallel>(gomp) };
            unsafe {
                call(
                    omp_body,
                    &region as *const Region as *mut c_void,
                    threads as u32,
                    0,
                )
            };
        }
        Mode::Omp | Mode::Rayon => {
            let pool = rayon_pool(threads);
            pool.broadcast(|_| region.drain());
        }
    }
    if region.panicked.load(Ordering::Relaxed) {
        Err(())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_in_each_mode() {
        for mode in [Mode::Single, Mode::Rayon, Mode::Omp] {
            let hits: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
            for_each(100, 3, mode, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn a_panicking_task_is_reported() {
        assert!(for_each(10, 2, Mode::Rayon, &|i| assert!(i != 5)).is_err());
    }
}
