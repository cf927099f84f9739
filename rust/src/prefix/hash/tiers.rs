//! The hash cache's tier side: entries whose KV left L1 stay while an L2 slot holds it, so one
//! walk over the chained hashes reports a prefix per tier.
//!
//! An entry is `(l1, l2)` under its chained hash: an L1 block and/or an L2 slot. Back-pointers
//! `hash[b]` (L1 block) and `slot_hash[s]` (L2 slot) name the entry, so eviction of either side
//! clears exactly its reference, and an entry with neither is removed at once: the map never
//! holds more than L1 blocks + L2 slots entries. Token ids are kept per L1 block and per L2
//! slot, and a hash match counts only when they equal the query's (`prefix_hash="xxh3"` and
//! `"sha256"` alike). Costs: one hash and one probe per block walked, as the L1-only match.

use super::{Entry, HashCache, ROOT_HASH};
use crate::error::{KvError, KvResult};
use crate::prefix::radix::{NO_BLOCK, NO_SLOT};

impl HashCache {
    /// Entries that reference an L2 slot.
    pub fn num_l2(&self) -> usize {
        self.slot_hash.iter().filter(|h| h.is_some()).count()
    }

    /// One walk over the full blocks of `tokens[..max_tokens]` in `ns`: the leading blocks in
    /// L1 go to `l1`, the L2 slots of the blocks right after them to `l2`. Returns the L1
    /// prefix length in tokens.
    pub fn match_tiered(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        l1: &mut Vec<u32>,
        l2: &mut Vec<u32>,
    ) -> usize {
        self.walk(ns, tokens, max_tokens, l1, Some(l2))
    }

    pub(super) fn walk(
        &mut self,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
        l1: &mut Vec<u32>,
        mut l2: Option<&mut Vec<u32>>,
    ) -> usize {
        let bs = self.block_size;
        let limit = tokens.len().min(max_tokens);
        let (mut parent, mut n, mut in_l1) = (ROOT_HASH, 0, true);
        for chunk in tokens[..limit].chunks_exact(bs) {
            let h = self.hash(parent, ns, chunk);
            let Some(&e) = self.map.get(&h) else {
                break;
            };
            if self.entry_tokens(e) != chunk {
                break;
            }
            if in_l1 && e.l1 != NO_BLOCK {
                l1.push(e.l1);
                n += bs;
            } else {
                in_l1 = false;
                match l2.as_deref_mut() {
                    Some(v) if e.l2 != NO_SLOT => v.push(e.l2),
                    _ => break,
                }
            }
            parent = h;
        }
        n
    }

    /// Names L2 slot `s` on the entry of the last block of `tokens` (whole blocks) in `ns`,
    /// creating it if missing. False (nothing changed): tokens differ from the entry's (a
    /// collision) or the entry names another slot.
    pub fn attach_l2(&mut self, ns: u64, tokens: &[u32], s: u32) -> bool {
        let bs = self.block_size;
        if tokens.is_empty() || tokens.len() % bs != 0 || self.slot_of(s).is_some() {
            return false;
        }
        let mut h = ROOT_HASH;
        for chunk in tokens.chunks_exact(bs) {
            h = self.hash(h, ns, chunk);
        }
        let last = &tokens[tokens.len() - bs..];
        let e = match self.map.get(&h).copied() {
            Some(e) if e.l2 != NO_SLOT || self.entry_tokens(e) != last => return false,
            Some(e) => e,
            None => Entry {
                l1: NO_BLOCK,
                l2: NO_SLOT,
            },
        };
        self.map.insert(h, Entry { l2: s, ..e });
        self.name_slot_tokens(s, h, last.to_vec());
        true
    }

    /// L2 slot `s` was evicted (or reused): its entry forgets it, and goes if not in L1 either.
    pub fn drop_l2(&mut self, s: u32) {
        let Some(h) = self.slot_of(s) else {
            return;
        };
        self.slot_hash[s as usize] = None;
        let e = self.map[&h];
        if e.l1 == NO_BLOCK {
            self.map.remove(&h);
        } else {
            self.map.insert(h, Entry { l2: NO_SLOT, ..e });
        }
    }

    fn slot_of(&self, s: u32) -> Option<u128> {
        self.slot_hash.get(s as usize).copied().flatten()
    }

    /// Slot `s` now holds the entry `h` with the tokens of L1 block `b`.
    pub(super) fn name_slot(&mut self, s: u32, h: u128, b: u32) {
        let tokens = self.tokens_of(b).to_vec();
        self.name_slot_tokens(s, h, tokens);
    }

    fn name_slot_tokens(&mut self, s: u32, h: u128, tokens: Vec<u32>) {
        let (i, bs) = (s as usize, self.block_size);
        if self.slot_hash.len() <= i {
            self.slot_hash.resize(i + 1, None);
            self.slot_tokens.resize((i + 1) * bs, 0);
        }
        self.slot_hash[i] = Some(h);
        self.slot_tokens[i * bs..(i + 1) * bs].copy_from_slice(&tokens);
    }

    /// Every entry as (hash, L1 block or `NO_BLOCK`, L2 slot or `NO_SLOT`).
    pub fn entries(&self) -> Vec<(u128, u32, u32)> {
        self.map.iter().map(|(&h, e)| (h, e.l1, e.l2)).collect()
    }

    /// The entry of the chained hash of `tokens`' full blocks, tokens compared (brute force).
    pub fn entry_of_path(&mut self, ns: u64, tokens: &[u32]) -> Option<(u32, u32)> {
        let bs = self.block_size;
        let mut h = ROOT_HASH;
        for chunk in tokens.chunks_exact(bs) {
            h = self.hash(h, ns, chunk);
        }
        let e = *self.map.get(&h)?;
        (self.entry_tokens(e) == &tokens[tokens.len() - bs..]).then_some((e.l1, e.l2))
    }

    /// Map and both back-pointer indexes agree; every entry holds KV on some tier.
    pub fn check_invariants(&self) -> KvResult<()> {
        let bad = |m: String| Err(KvError::Invariant(format!("hash cache: {m}")));
        for (&h, e) in &self.map {
            if e.l1 == NO_BLOCK && e.l2 == NO_SLOT {
                return bad(format!("entry {h:x} holds KV on no tier"));
            }
            if e.l1 != NO_BLOCK && self.hash.get(e.l1 as usize).copied().flatten() != Some(h) {
                return bad(format!("block {} not keyed by its hash", e.l1));
            }
            if e.l2 != NO_SLOT && self.slot_of(e.l2) != Some(h) {
                return bad(format!("slot {} not keyed by its entry", e.l2));
            }
        }
        let n = self.hash.iter().filter(|h| h.is_some()).count();
        let in_l1 = self.map.values().filter(|e| e.l1 != NO_BLOCK).count();
        if n != in_l1 || n != self.num_cached {
            return bad(format!("{n} hashed blocks, {in_l1} entries in L1"));
        }
        let in_l2 = self.map.values().filter(|e| e.l2 != NO_SLOT).count();
        if in_l2 != self.num_l2() {
            return bad(format!(
                "{} named slots, {in_l2} entries in L2",
                self.num_l2()
            ));
        }
        Ok(())
    }
}
