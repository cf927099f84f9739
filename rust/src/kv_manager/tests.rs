//! Scripted unit tests of the KV manager: exact block ids, ref counts and free-queue order.

use super::*;

fn mgr(num_blocks: u32, block_size: u32, mode: PrefixMode) -> KvManager {
    KvManager::new(KvManagerConfig {
        num_blocks,
        block_size,
        prefix_mode: mode,
    })
    .unwrap()
}

fn refs(m: &KvManager, ids: &[u32]) -> Vec<u32> {
    ids.iter().map(|&b| m.ref_count(b).unwrap()).collect()
}

/// Admits `req` with a prefix lookup capped at len - 1, covering the whole prompt.
fn admit_prompt(m: &mut KvManager, req: u64, ns: u64, toks: &[u32]) -> (bool, usize) {
    let hit = m.match_prefix(ns, toks, toks.len() - 1);
    let ok = m
        .admit(req, ns, toks, &hit, toks.len() - hit.num_tokens, 0)
        .unwrap();
    m.check_invariants().unwrap();
    (ok, hit.num_tokens)
}

#[test]
fn config_is_validated() {
    let bad = |n, bs| {
        KvManager::new(KvManagerConfig {
            num_blocks: n,
            block_size: bs,
            prefix_mode: PrefixMode::Radix,
        })
    };
    assert!(matches!(bad(8, 0), Err(KvError::InvalidArgument(_))));
    assert!(matches!(bad(1, 16), Err(KvError::InvalidArgument(_))));
    assert!(matches!(
        bad(1 << 20, 1 << 20),
        Err(KvError::InvalidArgument(_))
    ));
    assert!(bad(2, 1).is_ok());
}

#[test]
fn admit_and_free_without_prefix_cache() {
    let mut m = mgr(8, 4, PrefixMode::Off);
    let toks: Vec<u32> = (0..10).collect();
    let hit = m.match_prefix(0, &toks, 9);
    assert_eq!(hit.num_tokens, 0);
    assert!(m.admit(1, 0, &toks, &hit, 10, 0).unwrap());
    assert_eq!(m.block_table(1).unwrap(), &[1, 2, 3]);
    assert_eq!(m.num_free_blocks(), 4);
    assert!((m.usage() - 3.0 / 7.0).abs() < 1e-12);
    m.check_invariants().unwrap();
    m.free(1, &toks).unwrap();
    assert_eq!(m.free_queue(), vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(m.stats().cached_blocks, 0);
    m.check_invariants().unwrap();
}

#[test]
fn radix_free_caches_full_blocks_and_a_hit_revives_them() {
    let mut m = mgr(8, 4, PrefixMode::Radix);
    let a: Vec<u32> = (0..10).collect();
    assert_eq!(admit_prompt(&mut m, 1, 0, &a), (true, 0));
    assert_eq!(m.block_table(1).unwrap(), &[1, 2, 3]);
    m.free(1, &a).unwrap();
    // Block 3 (partial, uncached) goes to the head; 2 then 1 join the LRU tail.
    assert_eq!(m.free_queue(), vec![3, 4, 5, 6, 7, 2, 1]);
    assert_eq!(m.stats().cached_blocks, 2);
    // Same first 9 tokens: the hit is the two full blocks (8 tokens).
    let b: Vec<u32> = (0..9).chain([100, 101]).collect();
    assert_eq!(admit_prompt(&mut m, 2, 0, &b), (true, 8));
    assert_eq!(m.block_table(2).unwrap(), &[1, 2, 3]);
    assert_eq!(refs(&m, &[1, 2, 3]), vec![1, 1, 1]);
    assert_eq!(m.free_queue(), vec![4, 5, 6, 7]);
    let s = m.stats();
    assert_eq!((s.queries, s.query_tokens, s.hit_tokens), (2, 21, 8));
}

#[test]
fn token_granularity_hit_copies_the_partly_matched_block() {
    let mut m = mgr(8, 4, PrefixMode::Radix);
    let a: Vec<u32> = (0..8).collect();
    admit_prompt(&mut m, 1, 0, &a);
    m.free(1, &a).unwrap();
    assert_eq!(m.free_queue(), vec![3, 4, 5, 6, 7, 2, 1]);
    // Shares 6 tokens with a: block 1 fully, block 2 for 2 of its 4 tokens.
    let b: Vec<u32> = (0..6).chain([50, 51, 52]).collect();
    assert_eq!(admit_prompt(&mut m, 2, 0, &b), (true, 6));
    assert_eq!(m.block_table(2).unwrap(), &[1, 3, 4]);
    // Block 2 is held by the pending copy op until it is drained.
    assert_eq!(refs(&m, &[1, 2, 3, 4]), vec![1, 1, 1, 1]);
    let mut ops = Vec::new();
    m.drain_copy_ops(&mut ops);
    assert_eq!(ops, vec![[2, 3]]);
    assert_eq!(m.ref_count(2).unwrap(), 0);
    assert_eq!(m.free_queue(), vec![5, 6, 7, 2]);
    m.check_invariants().unwrap();
    // Once computed, b's second block is a sibling of block 2 in the tree.
    m.free(2, &b).unwrap();
    let c: Vec<u32> = (0..6).chain([50, 51, 99]).collect();
    assert_eq!(admit_prompt(&mut m, 3, 0, &c), (true, 8));
    assert_eq!(&m.block_table(3).unwrap()[..2], &[1, 3]);
}

#[test]
fn fork_shares_blocks_and_the_first_writer_copies() {
    let mut m = mgr(8, 4, PrefixMode::Off);
    let hit = PrefixHit::default();
    assert!(m.admit(1, 0, &[], &hit, 6, 0).unwrap());
    m.fork(1, 2).unwrap();
    assert_eq!(m.block_table(2).unwrap(), &[1, 2]);
    assert_eq!(refs(&m, &[1, 2]), vec![2, 2]);
    assert!(m.allocate_slots(2, 7).unwrap());
    assert_eq!(m.block_table(2).unwrap(), &[1, 3]);
    assert_eq!(refs(&m, &[1, 2, 3]), vec![2, 2, 1]);
    m.check_invariants().unwrap();
    // The parent is now the only table holding block 2: it writes in place.
    assert!(m.allocate_slots(1, 8).unwrap());
    assert_eq!(m.block_table(1).unwrap(), &[1, 2]);
    let mut ops = Vec::new();
    m.drain_copy_ops(&mut ops);
    assert_eq!(ops, vec![[2, 3]]);
    assert_eq!(refs(&m, &[1, 2, 3]), vec![2, 1, 1]);
    // Full last blocks are shared read-only: growing needs no copy.
    m.fork(1, 3).unwrap();
    assert!(m.allocate_slots(3, 9).unwrap());
    assert_eq!(m.block_table(3).unwrap(), &[1, 2, 4]);
    assert_eq!(m.num_pending_copy_ops(), 0);
    m.free(1, &[]).unwrap();
    m.free(2, &[]).unwrap();
    m.free(3, &[]).unwrap();
    assert_eq!(m.free_queue(), vec![1, 2, 4, 3, 5, 6, 7]);
    m.check_invariants().unwrap();
}

#[test]
fn eviction_takes_uncached_blocks_first_then_lru_leaves() {
    let mut m = mgr(6, 2, PrefixMode::Radix);
    let a = [1, 2, 3, 4];
    let b = [7, 8, 9, 10];
    admit_prompt(&mut m, 1, 0, &a);
    m.free(1, &a).unwrap(); // caches 1, 2
    admit_prompt(&mut m, 2, 0, &b);
    assert_eq!(m.block_table(2).unwrap(), &[3, 4]);
    m.free(2, &b).unwrap(); // caches 3, 4
    assert_eq!(m.free_queue(), vec![5, 2, 1, 4, 3]);
    // Three blocks: the free 5, then a's leaf 2, then a's root block 1.
    let c = [20, 21, 22, 23, 24, 25];
    assert_eq!(admit_prompt(&mut m, 3, 0, &c), (true, 0));
    assert_eq!(m.block_table(3).unwrap(), &[5, 2, 1]);
    assert_eq!(m.stats().evictions, 2);
    assert_eq!(m.stats().cached_blocks, 2);
    assert_eq!(m.match_prefix(0, &a, 3).num_tokens, 0);
    assert_eq!(m.match_prefix(0, &b, 3).num_tokens, 3);
    m.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_and_watermark_change_nothing() {
    let mut m = mgr(6, 2, PrefixMode::Radix);
    let a = [1, 2, 3, 4];
    admit_prompt(&mut m, 1, 0, &a);
    m.free(1, &a).unwrap();
    assert_eq!(m.free_queue(), vec![3, 4, 5, 2, 1]);
    let hit = m.match_prefix(0, &[9; 6], 5);
    let snap = format!("{m:?}");
    assert!(!m.admit(2, 0, &[9; 6], &hit, 6, 3).unwrap());
    assert_eq!(format!("{m:?}"), snap);
    assert!(m.admit(2, 0, &[9; 6], &hit, 6, 2).unwrap());
    assert_eq!(m.block_table(2).unwrap(), &[3, 4, 5]);
    assert_eq!(m.stats().evictions, 0);
    assert!(m.allocate_slots(2, 8).unwrap());
    assert_eq!(m.block_table(2).unwrap(), &[3, 4, 5, 2]);
    assert_eq!(m.stats().evictions, 1);
    let hit = m.match_prefix(0, &[8; 4], 3);
    let snap = format!("{m:?}");
    assert!(!m.admit(3, 0, &[8; 4], &hit, 4, 0).unwrap());
    assert_eq!(format!("{m:?}"), snap);
    assert!(m.allocate_slots(2, 10).unwrap());
    assert_eq!(m.block_table(2).unwrap(), &[3, 4, 5, 2, 1]);
    assert_eq!(m.stats().evictions, 2);
    assert!(m.admit(9, 5, &[], &PrefixHit::default(), 1, 0).is_ok());
    let mut small = mgr(4, 2, PrefixMode::Off);
    assert!(small.admit(1, 0, &[], &PrefixHit::default(), 4, 0).unwrap());
    assert!(small.admit(2, 0, &[], &PrefixHit::default(), 2, 0).unwrap());
    let snap = format!("{small:?}");
    assert!(!small.allocate_slots(1, 6).unwrap());
    assert_eq!(format!("{small:?}"), snap);
    m.check_invariants().unwrap();
}

#[test]
fn namespaces_never_share_hits() {
    for mode in [PrefixMode::Radix, PrefixMode::Hash] {
        let mut m = mgr(16, 4, mode);
        let a: Vec<u32> = (0..12).collect();
        admit_prompt(&mut m, 1, 7, &a);
        m.free(1, &a).unwrap();
        assert_eq!(admit_prompt(&mut m, 2, 8, &a), (true, 0), "{mode:?}");
        let want = if mode == PrefixMode::Radix { 11 } else { 8 };
        assert_eq!(admit_prompt(&mut m, 3, 7, &a), (true, want), "{mode:?}");
    }
}

#[test]
fn hash_mode_matches_full_blocks_with_stable_hashes() {
    let mut m = mgr(16, 4, PrefixMode::Hash);
    let a: Vec<u32> = (0..10).collect();
    admit_prompt(&mut m, 1, 3, &a);
    m.free(1, &a).unwrap();
    let b: Vec<u32> = (0..6).chain([40, 41]).collect();
    assert_eq!(admit_prompt(&mut m, 2, 3, &b), (true, 4));
    let mut scratch = Vec::new();
    let h0 =
        crate::prefix::hash::block_hash(crate::prefix::hash::ROOT_HASH, 3, &a[..4], &mut scratch);
    let h1 = crate::prefix::hash::block_hash(h0, 3, &a[4..8], &mut scratch);
    assert_eq!(m.block_hash(1), Some(h0));
    assert_eq!(m.block_hash(2), Some(h1));
    // Fixed value: hashes must not change between processes or releases.
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u128.to_le_bytes());
    bytes.extend_from_slice(&3u64.to_le_bytes());
    for t in 0u32..4 {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    assert_eq!(h0, xxhash_rust::xxh3::xxh3_128(&bytes));
    assert_ne!(
        h0,
        crate::prefix::hash::block_hash(0, 4, &a[..4], &mut scratch)
    );
}

#[test]
fn duplicate_blocks_switch_to_the_cached_twin() {
    for mode in [PrefixMode::Radix, PrefixMode::Hash] {
        let mut m = mgr(16, 4, mode);
        let a: Vec<u32> = (0..9).collect();
        admit_prompt(&mut m, 1, 0, &a);
        admit_prompt(&mut m, 2, 0, &a); // computed concurrently: no hit yet
        assert_eq!(m.block_table(2).unwrap(), &[4, 5, 6]);
        m.cache_computed(1, &a).unwrap();
        m.cache_computed(2, &a).unwrap();
        assert_eq!(m.block_table(2).unwrap(), &[1, 2, 6], "{mode:?}");
        assert_eq!(refs(&m, &[1, 2, 4, 5]), vec![2, 2, 0, 0]);
        assert_eq!(m.free_queue()[..2], [5, 4]);
        assert_eq!(m.stats().deduplicated_blocks, 2);
        m.check_invariants().unwrap();
    }
}

#[test]
fn bad_input_changes_nothing() {
    let mut m = mgr(8, 4, PrefixMode::Radix);
    let a: Vec<u32> = (0..10).collect();
    admit_prompt(&mut m, 1, 0, &a);
    m.cache_computed(1, &a[..8]).unwrap();
    let hit = m.match_prefix(0, &a, 9);
    assert_eq!(m.match_prefix(5, &a, 9).num_tokens, 0);
    let before = format!("{m:?}");
    let same = |m: &KvManager| assert_eq!(format!("{m:?}"), before);
    assert_eq!(
        m.admit(1, 0, &a, &hit, 2, 0),
        Err(KvError::DuplicateRequest(1))
    );
    same(&m);
    assert!(matches!(
        m.admit(2, 0, &a, &PrefixHit::default(), 0, 0),
        Err(KvError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.admit(2, 0, &a, &PrefixHit::default(), 29, 0),
        Err(KvError::TooLong(_))
    ));
    assert!(matches!(
        m.admit(2, 0, &a[..3], &hit, 2, 0),
        Err(KvError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.admit(2, 5, &a, &hit, 2, 0),
        Err(KvError::InvalidArgument(_))
    ));
    same(&m);
    assert_eq!(m.allocate_slots(9, 4), Err(KvError::UnknownRequest(9)));
    assert!(matches!(m.allocate_slots(1, 29), Err(KvError::TooLong(_))));
    assert!(matches!(
        m.cache_computed(1, &[0; 11]),
        Err(KvError::InvalidArgument(_))
    ));
    assert!(matches!(
        m.free(1, &[0; 11]),
        Err(KvError::InvalidArgument(_))
    ));
    assert_eq!(m.free(9, &[]), Err(KvError::UnknownRequest(9)));
    assert_eq!(m.fork(9, 3), Err(KvError::UnknownRequest(9)));
    assert_eq!(m.fork(1, 1), Err(KvError::DuplicateRequest(1)));
    assert_eq!(m.block_table(9), Err(KvError::UnknownRequest(9)));
    assert!(matches!(m.ref_count(8), Err(KvError::InvalidBlock(_))));
    same(&m);
    m.free(1, &a).unwrap();
    assert_eq!(m.free(1, &a), Err(KvError::UnknownRequest(1)));
    m.check_invariants().unwrap();
}

#[test]
fn stale_hit_is_rematched_or_refused() {
    let mut m = mgr(5, 2, PrefixMode::Radix);
    let a = [1, 2, 3, 4, 5];
    admit_prompt(&mut m, 1, 0, &a);
    m.free(1, &a).unwrap(); // caches 1, 2; block 3 free
    let hit = m.match_prefix(0, &a, 4);
    assert_eq!(hit.num_tokens, 4);
    // Another admission evicts block 2 (the LRU leaf) after the match.
    let hit_b = m.match_prefix(0, &[9, 9, 9, 9], 3);
    assert!(m.admit(2, 0, &[9, 9, 9, 9], &hit_b, 4, 0).unwrap());
    assert_eq!(m.block_table(2).unwrap(), &[3, 4]);
    let hit_c = m.match_prefix(0, &[7, 7], 1);
    assert!(m.admit(3, 0, &[7, 7], &hit_c, 2, 0).unwrap());
    let before = format!("{m:?}");
    assert!(matches!(
        m.admit(4, 0, &a, &hit, 1, 0),
        Err(KvError::InvalidArgument(_))
    ));
    assert_eq!(format!("{m:?}"), before);
    m.check_invariants().unwrap();
}
