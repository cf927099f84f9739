//! Unit tests of the radix prefix cache: paths, token-granularity hits, namespaces, leaf-first
//! LRU eviction and invariants after every operation.

use super::*;

/// Inserts `blocks` as one path of `tokens` (block size 2) and returns the outcomes.
fn path(c: &mut RadixCache, ns: u64, tokens: &[u32], blocks: &[u32]) -> Vec<InsertOutcome> {
    let mut parent = NULL_BLOCK;
    let mut out = Vec::new();
    for (i, &b) in blocks.iter().enumerate() {
        let o = c.insert_block(
            ns,
            parent,
            &tokens[2 * i..2 * i + 2],
            b,
            blocks.len() - i - 1,
        );
        parent = match o {
            InsertOutcome::Existing(x) => x,
            _ => b,
        };
        out.push(o);
    }
    c.check_invariants().unwrap();
    out
}

fn matched(c: &RadixCache, ns: u64, tokens: &[u32]) -> (usize, Vec<u32>) {
    let mut out = Vec::new();
    let n = c.match_prefix(ns, tokens, tokens.len(), &mut out);
    (n, out)
}

#[test]
fn sequential_inserts_extend_one_edge_and_splits_keep_ids() {
    let mut c = RadixCache::new(16, 2);
    path(&mut c, 0, &[1, 2, 3, 4, 5, 6], &[1, 2, 3]);
    assert_eq!(c.num_nodes(), 2); // root + one edge of three blocks
    assert_eq!(matched(&c, 0, &[1, 2, 3, 4, 5, 6]), (6, vec![1, 2, 3]));
    // Diverging after one block splits the edge.
    let got = path(&mut c, 0, &[1, 2, 3, 9], &[7, 8]);
    assert_eq!(
        got,
        vec![InsertOutcome::Existing(1), InsertOutcome::Inserted]
    );
    assert_eq!(c.num_nodes(), 4);
    assert_eq!(matched(&c, 0, &[1, 2, 3, 9]), (4, vec![1, 8]));
    assert_eq!(matched(&c, 0, &[1, 2, 3, 4, 5]), (5, vec![1, 2, 3]));
    // Token granularity: a match may end inside a block.
    assert_eq!(matched(&c, 0, &[1, 2, 3, 7]), (3, vec![1, 2])); // tie: lowest id
    assert_eq!(matched(&c, 0, &[1, 7]), (1, vec![1]));
    assert_eq!(matched(&c, 0, &[2]), (0, vec![]));
    assert_eq!(c.num_cached(), 4);
}

#[test]
fn ties_go_to_the_lowest_block_and_namespaces_are_separate() {
    let mut c = RadixCache::new(16, 2);
    path(&mut c, 0, &[5, 6], &[9]);
    path(&mut c, 0, &[5, 7], &[4]);
    assert_eq!(matched(&c, 0, &[5, 8]), (1, vec![4]));
    assert_eq!(matched(&c, 1, &[5, 6]), (0, vec![]));
    assert_eq!(
        path(&mut c, 1, &[5, 6], &[3]),
        vec![InsertOutcome::Inserted]
    );
    assert_eq!(matched(&c, 1, &[5, 6]), (2, vec![3]));
}

#[test]
fn eviction_trims_leaves_and_drops_subtrees_below_inner_blocks() {
    let mut c = RadixCache::new(16, 2);
    path(&mut c, 0, &[1, 2, 3, 4, 5, 6], &[1, 2, 3]);
    path(&mut c, 0, &[1, 2, 3, 4, 7, 8], &[1, 2, 5]);
    let mut dropped = Vec::new();
    c.evict(5, None, &mut dropped);
    assert!(dropped.is_empty());
    assert_eq!(c.num_cached(), 3);
    c.check_invariants().unwrap();
    // Block 1 is inner: everything below it goes with it, and the empty root too.
    c.evict(1, None, &mut dropped);
    dropped.sort();
    assert_eq!(dropped, vec![2, 3]);
    assert_eq!(
        (c.num_cached(), c.num_nodes(), c.inner_evictions()),
        (0, 0, 1)
    );
    c.check_invariants().unwrap();
    assert_eq!(
        path(&mut c, 0, &[1, 2], &[6]),
        vec![InsertOutcome::Inserted]
    );
}

#[test]
fn a_parent_that_is_no_longer_cached_is_reported() {
    let mut c = RadixCache::new(8, 2);
    path(&mut c, 0, &[1, 2], &[1]);
    c.evict(1, None, &mut Vec::new());
    assert_eq!(
        c.insert_block(0, 1, &[3, 4], 2, 0),
        InsertOutcome::ParentNotCached
    );
    c.check_invariants().unwrap();
}

fn tiered(c: &RadixCache, tokens: &[u32]) -> (usize, Vec<u32>, Vec<u32>) {
    let (mut l1, mut l2) = (Vec::new(), Vec::new());
    let n = c.match_tiered(0, tokens, tokens.len(), &mut l1, &mut l2);
    (n, l1, l2)
}

#[test]
fn evicted_entries_stay_on_l2_and_blocks_reattach() {
    let mut c = RadixCache::new(16, 2);
    path(&mut c, 0, &[1, 2, 3, 4, 5, 6], &[1, 2, 3]);
    let mut dropped = Vec::new();
    c.evict(3, Some(7), &mut dropped);
    assert_eq!(matched(&c, 0, &[1, 2, 3, 4, 5, 6]), (4, vec![1, 2]));
    assert_eq!(tiered(&c, &[1, 2, 3, 4, 5, 6]), (4, vec![1, 2], vec![7]));
    // An inner block leaves L1 while the entry below it is on L2 only: both stay.
    c.evict(2, Some(8), &mut dropped);
    assert_eq!(tiered(&c, &[1, 2, 3, 4, 5, 6]), (2, vec![1], vec![8, 7]));
    assert_eq!((c.num_cached(), c.num_l2()), (1, 2));
    c.check_invariants().unwrap();
    // A load back into L1 re-attaches to the same entry, which keeps its slot.
    assert_eq!(c.insert_block(0, 1, &[3, 4], 9, 0), InsertOutcome::Inserted);
    assert_eq!(tiered(&c, &[1, 2, 3, 4, 5, 6]), (4, vec![1, 9], vec![7]));
    c.drop_l2(8, &mut dropped);
    assert_eq!(c.num_l2(), 1);
    c.check_invariants().unwrap();
    // Out of L1 with no L2 copy: the entry and everything below it go.
    c.evict(9, None, &mut dropped);
    assert_eq!(tiered(&c, &[1, 2, 3, 4, 5, 6]), (2, vec![1], vec![]));
    assert_eq!((c.num_l2(), c.num_nodes(), dropped.len()), (0, 2, 0));
    c.check_invariants().unwrap();
}

#[test]
fn l2_drops_prune_paths_and_attach_needs_the_path() {
    let mut c = RadixCache::new(16, 2);
    path(&mut c, 0, &[1, 2, 3, 4, 5, 6], &[1, 2, 3]);
    let mut dropped = Vec::new();
    c.evict(2, Some(5), &mut dropped);
    // The L2-only entry loses its slot: block 3 below it can no longer be reached.
    c.drop_l2(5, &mut dropped);
    assert_eq!(dropped, vec![3]);
    assert_eq!((c.num_cached(), c.num_l2()), (1, 0));
    c.check_invariants().unwrap();
    assert!(c.attach_l2(0, &[1, 2, 3, 4], 4));
    assert!(!c.attach_l2(0, &[9, 9, 3, 4], 5), "path missing");
    assert!(
        !c.attach_l2(0, &[1, 2, 3, 4], 6),
        "entry names another slot"
    );
    assert!(!c.attach_l2(0, &[1, 2, 7, 7], 4), "slot named elsewhere");
    assert_eq!(tiered(&c, &[1, 2, 3, 4, 5]), (2, vec![1], vec![4]));
    assert_eq!(
        tiered(&c, &[1, 2, 3]),
        (2, vec![1], vec![]),
        "L2 hits are whole blocks"
    );
    c.check_invariants().unwrap();
}

#[test]
fn a_partial_l1_hit_beside_an_l2_only_block_is_kept() {
    let mut c = RadixCache::new(16, 2);
    path(&mut c, 0, &[1, 2, 3, 4], &[1, 2]);
    path(&mut c, 0, &[1, 2, 3, 5], &[1, 6]);
    c.evict(2, Some(3), &mut Vec::new());
    assert_eq!(matched(&c, 0, &[1, 2, 3, 4, 8]), (3, vec![1, 6]));
    assert_eq!(tiered(&c, &[1, 2, 3, 4, 8]), (3, vec![1, 6], vec![3]));
    c.check_invariants().unwrap();
}
