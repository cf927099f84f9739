//! KV tiers below the block pool: what the core knows about blocks that left L1.
//!
//! ```text
//!   L1 device pool ──evict (write-back)──► L2 host slots
//!        ▲                                      │    ▲
//!        └──────────── load (admission) ────────┘    └── fetch (background I/O) ── L3 / L4 Redis
//!   a block cached in L1 for the first time ──publish (write-through)──► L3 disk, L4 Redis
//! ```
//!
//! Every cached block is named by a chained SHA-256 key, `key_i = SHA-256(key_{i-1} | ns |
//! tokens_i)`, rooted in a per-engine `root` that Python derives from the model fingerprint, the
//! storage format and the block size: a key from another model, format, block size or namespace
//! never matches. The core decides every move; a step's moves leave in the StepPlan as arrays
//! ([`TierOps`]): `offload` (L1 block, L2 slot) pairs, `load` (L2 slot, L1 block) pairs, `publish`
//! (blocks to write to L4) and `fetch` (keys a waiting sequence wants from L3/L4). The model
//! runner applies them before the forward, in this order: publish reads, offloads, loads, then
//! copy-on-write copies, so that every read sees a block before anything overwrites it.
//!
//! L2 is a cache of its own (LRU, fixed slot count) plus private slots for swapped-out
//! sequences ([`host::HostTier`]). In-flight state: a slot read by a pending load is pinned until
//! the plan is drained; a sequence whose keys are being fetched waits (`fetching`) until Python
//! reports the fetch done (`Scheduler::tier_fetched`), then it is admitted with whatever arrived.

mod fetch;
pub mod host;
#[cfg(test)]
mod proptests;
mod rows;
mod state;

pub use fetch::Fetched;
pub use host::{HostTier, SlotState};
pub use rows::copy_block_rows;
pub use state::{Swap, TierOps, TierStats, Tiers};

use sha2::{Digest, Sha256};

use crate::error::{KvError, KvResult};

/// A chained block key (SHA-256).
pub type BlockKey = [u8; 32];

/// The key of a block holding `tokens` in namespace `ns` after the block keyed `parent`.
pub fn chain_key(parent: &BlockKey, ns: u64, tokens: &[u32]) -> BlockKey {
    let mut h = Sha256::new();
    h.update(parent);
    h.update(ns.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The key of the last full block of `tokens` (a whole number of `block_size` blocks).
pub fn chain_from_root(root: BlockKey, ns: u64, tokens: &[u32], block_size: usize) -> BlockKey {
    tokens
        .chunks_exact(block_size)
        .fold(root, |k, c| chain_key(&k, ns, c))
}

/// How a preempted sequence gets its KV back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// Free its blocks (full ones stay cached) and recompute what is not cached later.
    Recompute,
    /// Copy its blocks to L2 private slots and load them back on readmission.
    Swap,
    /// Per sequence: swap when bytes over copy bandwidth cost less than recomputing.
    Auto,
}

impl Preemption {
    /// Parses "recompute", "swap" or "auto".
    pub fn parse(s: &str) -> KvResult<Self> {
        match s {
            "recompute" => Ok(Preemption::Recompute),
            "swap" => Ok(Preemption::Swap),
            "auto" => Ok(Preemption::Auto),
            _ => Err(KvError::InvalidArgument(format!(
                "preemption must be 'auto', 'recompute' or 'swap', got {s:?}"
            ))),
        }
    }
}

/// What the tiers below L1 are and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct TierConfig {
    /// L2 host slots (0: no L2; then no swap and no fetch either).
    pub host_blocks: u32,
    /// Whether an L3 or L4 tier exists: waiting sequences ask it for the blocks L1/L2 lack.
    pub fetch: bool,
    /// Whether newly cached blocks are written through to L3/L4 (`publish` ops).
    pub publish: bool,
    /// Root of every key chain (model fingerprint, storage format, block size).
    pub root: BlockKey,
    /// Bytes of one block over all layers (the swap cost model).
    pub bytes_per_block: u64,
    /// Preemption mode.
    pub preemption: Preemption,
    /// Measured host copy bandwidth, bytes per second (Python updates it).
    pub copy_bytes_per_s: f64,
    /// Measured forward time per token, seconds (Python updates it).
    pub seconds_per_token: f64,
}

impl TierConfig {
    /// An L2 of `host_blocks` slots, no L3/L4, recompute preemption, default costs.
    pub fn new(host_blocks: u32) -> Self {
        TierConfig {
            host_blocks,
            fetch: false,
            publish: false,
            root: [0; 32],
            bytes_per_block: 1,
            preemption: Preemption::Recompute,
            copy_bytes_per_s: 5e9,
            seconds_per_token: 1e-4,
        }
    }

    /// Whether swapping out `num_blocks` blocks holding `num_tokens` computed tokens is
    /// cheaper than recomputing them: out and back in over the copy bandwidth, against the
    /// forward time of the tokens (it grows with the tokens already computed).
    pub fn prefer_swap(&self, num_blocks: usize, num_tokens: usize) -> bool {
        match self.preemption {
            Preemption::Recompute => false,
            Preemption::Swap => true,
            Preemption::Auto => {
                let copy = 2.0 * (num_blocks as u64 * self.bytes_per_block) as f64
                    / self.copy_bytes_per_s.max(1.0);
                copy < num_tokens as f64 * self.seconds_per_token
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_separate_namespaces() {
        let root = [7u8; 32];
        let a = chain_key(&root, 0, &[1, 2]);
        assert_eq!(a, chain_key(&root, 0, &[1, 2]));
        assert_ne!(a, chain_key(&root, 1, &[1, 2]));
        assert_ne!(a, chain_key(&[8u8; 32], 0, &[1, 2]));
        assert_ne!(chain_key(&a, 0, &[3, 4]), chain_key(&root, 0, &[3, 4]));
    }

    #[test]
    fn auto_preemption_swaps_long_sequences_only() {
        let mut c = TierConfig::new(8);
        c.preemption = Preemption::Auto;
        (c.bytes_per_block, c.copy_bytes_per_s, c.seconds_per_token) = (1000, 1e6, 1e-4);
        // 4 blocks: 8 ms of copies; 16 tokens recompute in 1.6 ms, 160 tokens in 16 ms.
        assert!(!c.prefer_swap(4, 16));
        assert!(c.prefer_swap(4, 160));
        assert!(Preemption::parse("sideways").is_err());
    }
}
