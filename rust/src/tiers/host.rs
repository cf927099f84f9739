//! L2, the host tier: a fixed set of host slots (one block of KV each, over all layers), an
//! index from chained block key to slot, and an LRU over the slots that may be evicted.
//!
//! A slot is in exactly one state: `Free`, `Cached` (named by `index`, evictable when its pin
//! count is 0) or `Private` (a swapped-out block of one preempted sequence; never evicted,
//! released by its owner). Pins are held by the pending load ops that read a slot: a pinned slot
//! is never evicted before the step that reads it has been planned and applied.
//!
//! Eviction order: least recently used first (`lru` is ordered by a tick bumped on insert and on
//! every hit). Slots keep the block's token ids beside its key, so a lookup compares tokens and a
//! hash match alone never loads a block.
//!
//! Costs: `lookup`, `insert`, `release` O(log slots) (the LRU is a `BTreeMap` keyed by tick).

use std::collections::{BTreeMap, HashMap};

use super::BlockKey;
use crate::error::{KvError, KvResult};

/// What a host slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Nothing.
    Free,
    /// A cached block, named in the index by this key.
    Cached(BlockKey),
    /// A swapped-out block of the sequence with this KV id.
    Private(u64),
}

/// The host tier's bookkeeping (the bytes live in a Python tensor of `num_slots` rows).
#[derive(Debug, Clone)]
pub struct HostTier {
    block_size: usize,
    state: Vec<SlotState>,
    tokens: Vec<u32>,
    pins: Vec<u32>,
    tick: Vec<u64>,
    index: HashMap<BlockKey, u32>,
    lru: BTreeMap<u64, u32>,
    free: Vec<u32>,
    clock: u64,
    /// Cached slots evicted to make room.
    pub evictions: u64,
    /// Cached slots evicted since the last `take_evicted` (the prefix cache drops them).
    evicted: Vec<u32>,
}

impl HostTier {
    /// `num_slots` empty slots for blocks of `block_size` tokens.
    pub fn new(num_slots: u32, block_size: u32) -> Self {
        let n = num_slots as usize;
        HostTier {
            block_size: block_size as usize,
            state: vec![SlotState::Free; n],
            tokens: vec![0; n * block_size as usize],
            pins: vec![0; n],
            tick: vec![0; n],
            index: HashMap::new(),
            lru: BTreeMap::new(),
            free: (0..num_slots).rev().collect(),
            clock: 0,
            evictions: 0,
            evicted: Vec::new(),
        }
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.state.len()
    }

    /// Number of cached blocks.
    pub fn num_cached(&self) -> usize {
        self.index.len()
    }

    /// The token ids stored beside slot `s`.
    pub fn tokens(&self, s: u32) -> &[u32] {
        let bs = self.block_size;
        &self.tokens[s as usize * bs..(s as usize + 1) * bs]
    }

    /// What slot `s` holds.
    pub fn state(&self, s: u32) -> SlotState {
        self.state[s as usize]
    }

    /// Whether `key` is cached (no LRU touch).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.contains_key(key)
    }

    /// The slot caching `key` whose stored tokens equal `tokens`; a hit is most recently used.
    pub fn lookup(&mut self, key: &BlockKey, tokens: &[u32]) -> Option<u32> {
        let s = *self.index.get(key)?;
        if self.tokens(s) != tokens {
            return None;
        }
        self.touch(s);
        Some(s)
    }

    /// Caches `key` (holding `tokens`) in a free or evicted slot; `None` when every slot is
    /// pinned or private. A key already cached keeps its slot (touched) and returns it.
    pub fn insert(&mut self, key: BlockKey, tokens: &[u32]) -> Option<(u32, bool)> {
        if let Some(&s) = self.index.get(&key) {
            self.touch(s);
            return Some((s, false));
        }
        let s = self.take_slot()?;
        self.state[s as usize] = SlotState::Cached(key);
        self.index.insert(key, s);
        self.set_tokens(s, tokens);
        self.touch(s);
        Some((s, true))
    }

    /// A private slot for a swapped-out block of sequence `owner`; `None` when none is free
    /// or evictable.
    pub fn alloc_private(&mut self, owner: u64) -> Option<u32> {
        let s = self.take_slot()?;
        self.state[s as usize] = SlotState::Private(owner);
        Some(s)
    }

    /// Frees a private slot (its owner is done with it).
    pub fn free_private(&mut self, s: u32) {
        debug_assert!(matches!(self.state[s as usize], SlotState::Private(_)));
        self.state[s as usize] = SlotState::Free;
        self.free.push(s);
    }

    /// Holds slot `s` against eviction (a pending load reads it).
    pub fn pin(&mut self, s: u32) {
        if self.pins[s as usize] == 0 {
            self.lru.remove(&self.tick[s as usize]);
        }
        self.pins[s as usize] += 1;
    }

    /// Releases one pin of slot `s`.
    pub fn unpin(&mut self, s: u32) {
        self.pins[s as usize] -= 1;
        if self.pins[s as usize] == 0 && matches!(self.state[s as usize], SlotState::Cached(_)) {
            self.lru.insert(self.tick[s as usize], s);
        }
    }

    /// The cached slots evicted since the last call, in order (a slot may have a new owner).
    pub fn take_evicted(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.evicted)
    }

    /// Whether any cached slot was evicted since the last `take_evicted`.
    pub fn has_evicted(&self) -> bool {
        !self.evicted.is_empty()
    }

    /// Marks slot `s` most recently used (a prefix hit on it).
    pub fn touch(&mut self, s: u32) {
        self.clock += 1;
        let i = s as usize;
        if self.pins[i] == 0 {
            self.lru.remove(&self.tick[i]);
            self.lru.insert(self.clock, s);
        }
        self.tick[i] = self.clock;
    }

    fn set_tokens(&mut self, s: u32, tokens: &[u32]) {
        let bs = self.block_size;
        self.tokens[s as usize * bs..(s as usize + 1) * bs].copy_from_slice(tokens);
    }

    /// A free slot, or the least recently used unpinned cached one (dropped from the index).
    fn take_slot(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let (_, s) = self.lru.pop_first()?;
        if let SlotState::Cached(k) = self.state[s as usize] {
            self.index.remove(&k);
        }
        self.state[s as usize] = SlotState::Free;
        self.evictions += 1;
        self.evicted.push(s);
        Some(s)
    }

    /// Every slot in one state; index, LRU and free list agree; pinned slots are not in the LRU.
    pub fn check_invariants(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("host tier: {m}")));
        let mut seen_free = vec![false; self.state.len()];
        for &s in &self.free {
            if self.state[s as usize] != SlotState::Free || seen_free[s as usize] {
                return bad(format!("free list names slot {s} twice or a used slot"));
            }
            seen_free[s as usize] = true;
        }
        let mut lru_count = 0;
        for (i, st) in self.state.iter().enumerate() {
            let s = i as u32;
            match *st {
                SlotState::Free if !seen_free[i] => return bad(format!("slot {s} lost")),
                SlotState::Cached(k) => {
                    if self.index.get(&k) != Some(&s) {
                        return bad(format!("cached slot {s} not indexed"));
                    }
                    let in_lru = self.lru.get(&self.tick[i]) == Some(&s);
                    if in_lru != (self.pins[i] == 0) {
                        return bad(format!("slot {s}: LRU membership disagrees with pins"));
                    }
                    lru_count += in_lru as usize;
                }
                SlotState::Private(_) if self.pins[i] != 0 => {
                    return bad(format!("private slot {s} pinned"))
                }
                _ => {}
            }
        }
        if lru_count != self.lru.len() || self.index.len() > self.state.len() {
            return bad(format!(
                "{} LRU entries, {lru_count} expected",
                self.lru.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        [i; 32]
    }

    #[test]
    fn lru_eviction_skips_pinned_and_private_slots() {
        let mut h = HostTier::new(3, 2);
        assert_eq!(h.insert(key(1), &[1, 2]), Some((0, true)));
        assert_eq!(h.insert(key(2), &[3, 4]), Some((1, true)));
        assert_eq!(h.alloc_private(9), Some(2));
        h.pin(0); // key 1 is being loaded
        assert_eq!(
            h.insert(key(3), &[5, 6]),
            Some((1, true)),
            "evicts key 2, not pinned key 1"
        );
        assert!(!h.contains(&key(2)) && h.contains(&key(1)));
        assert_eq!(h.insert(key(4), &[7, 8]), Some((1, true)));
        h.unpin(0);
        assert_eq!(h.lookup(&key(4), &[7, 8]), Some(1));
        assert_eq!(
            h.insert(key(5), &[9, 9]),
            Some((0, true)),
            "key 1 is now the LRU"
        );
        assert_eq!(h.lookup(&key(5), &[9, 8]), None, "tokens are compared");
        h.free_private(2);
        assert_eq!(h.evictions, 3);
        h.check_invariants().unwrap();
    }
}
