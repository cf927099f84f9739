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
    /// claim ahead: a thread claims its next task before running the current one, once at
    /// least this many unclaimed tasks remain (0: never)
    ahead_min: usize,
    panicked: AtomicBool,
    f: &'a (dyn Fn(usize, Option<usize>) + Sync),
}

impl Region<'_> {
    fn drain(&self) {
        let claim = || {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            (i < self.n).then_some(i)
        };
        let mut cur = claim();
        while let Some(i) = cur {
            // Claim the next task now (so this one can prefetch its data) only while enough
            // remain that holding one back cannot idle another thread at the end.
            let ahead = self.ahead_min > 0
                && self.n.saturating_sub(self.next.load(Ordering::Relaxed)) >= self.ahead_min;
            let next = if ahead { claim() } else { None };
            if catch_unwind(AssertUnwindSafe(|| (self.f)(i, next))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            cur = if ahead { next } else { claim() };
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
    region(n, threads, mode, false, &|i, _| f(i))
}

/// `for_each`, each task told the task its thread runs next (`f(i, Some(j))`), where known: a
/// thread claims its next task before it runs the current one while at least `2 * threads`
/// tasks are unclaimed (so that at the end no thread idles while another holds a task back).
/// The task can then prefetch the next one's data as it ends.
pub fn for_each_ahead(
    n: usize,
    threads: usize,
    mode: Mode,
    f: &(dyn Fn(usize, Option<usize>) + Sync),
) -> Result<(), ()> {
    region(n, threads, mode, true, f)
}

fn region(
    n: usize,
    threads: usize,
    mode: Mode,
    ahead: bool,
    f: &(dyn Fn(usize, Option<usize>) + Sync),
) -> Result<(), ()> {
    let threads = threads.clamp(1, n.max(1));
    let region = Region {
        next: AtomicUsize::new(0),
        n,
        ahead_min: match (ahead, threads) {
            (false, _) => 0,
            (true, 1) => 1,
            (true, t) => 2 * t,
        },
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
    fn claimed_ahead_every_task_runs_once_and_next_is_what_runs_next() {
        for mode in [Mode::Single, Mode::Rayon, Mode::Omp] {
            for threads in [1, 2, 3] {
                let n = 50;
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                // per task: the thread that ran it, and the task it was told comes next
                let told: Vec<Mutex<Option<(std::thread::ThreadId, usize)>>> =
                    (0..n).map(|_| Mutex::new(None)).collect();
                let ran: Vec<Mutex<Option<std::thread::ThreadId>>> =
                    (0..n).map(|_| Mutex::new(None)).collect();
                for_each_ahead(n, threads, mode, &|i, next| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    let me = std::thread::current().id();
                    *ran[i].lock().unwrap() = Some(me);
                    if let Some(j) = next {
                        *told[i].lock().unwrap() = Some((me, j));
                    }
                })
                .unwrap();
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
                let mut ahead = 0;
                for t in &told {
                    if let Some((me, j)) = *t.lock().unwrap() {
                        assert_eq!(*ran[j].lock().unwrap(), Some(me), "{mode:?} {threads}");
                        ahead += 1;
                    }
                }
                assert!(ahead >= n - 2 * threads - 1, "{mode:?} {threads}: {ahead}");
            }
        }
    }

    #[test]
    fn a_panicking_task_is_reported() {
        assert!(for_each(10, 2, Mode::Rayon, &|i| assert!(i != 5)).is_err());
    }
}
