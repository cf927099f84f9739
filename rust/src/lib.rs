//! kvcore's Rust core: the bookkeeping of a paged KV cache.
//!
//! What lives here: the block pool, per-request block tables with copy-on-write, the prefix
//! cache (radix tree and chained-hash modes) and the continuous-batching scheduler. No tensor,
//! no CUDA, no Python: the `py` module (behind the `python` feature that maturin turns on) is the
//! only place that mentions pyo3, so `cargo test` and `cargo bench` build and run without Python.
//!
//! Invariants are checked by `check_invariants()` on each structure; tests run it after every
//! operation. Misuse returns `Result<_, KvError>`; running out of blocks is an `Option`/`bool`
//! outcome, not an error. A panic is a bug.

pub mod block_pool;
pub mod block_table;
pub mod error;
pub mod kv_manager;
pub mod prefix;
pub mod request;
pub mod sched;
pub mod tiers;

#[cfg(feature = "python")]
mod py;

pub use block_pool::NULL_BLOCK;
pub use error::{KvError, KvResult};
pub use kv_manager::{CacheStats, KvManager, KvManagerConfig, PrefixHit};
pub use prefix::PrefixMode;
pub use request::{FinishReason, FinishedSeq, NewRequest};
pub use sched::{Policy, Scheduler, SchedulerConfig, SchedulerStats, StepPlan};
