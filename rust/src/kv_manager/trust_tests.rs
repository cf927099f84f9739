//! Tests of what the manager no longer takes on trust (issue 17): the tokens a request states
//! when its blocks are cached or freed, pending copy ops of a freed request, and the id range.

use super::*;

fn mgr(num_blocks: u32, block_size: u32, mode: PrefixMode) -> KvManager {
    KvManager::new(KvManagerConfig {
        num_blocks,
        block_size,
        prefix_mode: mode,
    })
    .unwrap()
}

fn admit_prompt(m: &mut KvManager, req: u64, toks: &[u32]) -> usize {
    let hit = m.match_prefix(0, toks, toks.len() - 1);
    assert!(m
        .admit(req, 0, toks, &hit, toks.len() - hit.num_tokens, 0)
        .unwrap());
    hit.num_tokens
}

#[test]
fn freeing_with_other_tokens_is_refused_and_publishes_nothing() {
    for mode in [PrefixMode::Radix, PrefixMode::Hash] {
        let mut m = mgr(16, 4, mode);
        let x: Vec<u32> = (0..12).collect();
        let y: Vec<u32> = (100..112).collect();
        admit_prompt(&mut m, 1, &x);
        let before = format!("{m:?}");
        for bad in [
            &y[..],
            &y[..4],
            &x[..11].iter().chain(&[7]).copied().collect::<Vec<_>>(),
        ] {
            let err = m.free(1, bad).unwrap_err();
            assert!(matches!(err, KvError::InvalidArgument(_)), "{err}");
            assert!(matches!(
                m.cache_computed(1, bad),
                Err(KvError::InvalidArgument(_))
            ));
            assert_eq!(format!("{m:?}"), before, "{mode:?}");
        }
        // Y's prompt finds nothing of X's; freed with its own tokens, X is hit by X only.
        assert_eq!(m.match_prefix(0, &y, 11).num_tokens, 0);
        m.free(1, &x).unwrap();
        assert_eq!(m.match_prefix(0, &y, 11).num_tokens, 0);
        let want = if mode == PrefixMode::Radix { 11 } else { 8 };
        assert_eq!(m.match_prefix(0, &x, 11).num_tokens, want);
        m.check_invariants().unwrap();
    }
}

#[test]
fn tokens_stated_once_bind_later_calls_but_a_partial_tail_may_change() {
    let mut m = mgr(16, 4, PrefixMode::Radix);
    // Admitted without a prompt: the first statement of full blocks is what it holds.
    assert!(m.admit(1, 0, &[], &PrefixHit::default(), 10, 0).unwrap());
    let a: Vec<u32> = (0..10).collect();
    m.cache_computed(1, &a).unwrap(); // full blocks 0..8 are now known; 8, 9 are not
    let mut b = a.clone();
    b[9] = 77; // inside the partial last block: allowed (e.g. a rejected draft token)
    m.cache_computed(1, &b).unwrap();
    b[3] = 77; // inside a full block already stated
    assert!(matches!(
        m.cache_computed(1, &b),
        Err(KvError::InvalidArgument(_))
    ));
    // A fork shares the known tokens of its blocks; beyond them the child may differ.
    m.fork(1, 2).unwrap();
    assert!(m.allocate_slots(2, 12).unwrap());
    let c: Vec<u32> = (0..8).chain([50, 51, 52, 53]).collect();
    m.free(2, &c).unwrap();
    assert!(matches!(m.free(1, &b), Err(KvError::InvalidArgument(_))));
    m.free(1, &a).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn freeing_cancels_its_pending_copy_and_the_block_is_not_overwritten() {
    let mut m = mgr(8, 4, PrefixMode::Radix);
    let a: Vec<u32> = (0..8).collect();
    admit_prompt(&mut m, 1, &a);
    m.free(1, &a).unwrap();
    // b shares 6 tokens: its copy of block 2 into block 3 is pending...
    let b: Vec<u32> = (0..6).chain([50, 51, 52]).collect();
    assert_eq!(admit_prompt(&mut m, 2, &b), 6);
    assert_eq!(m.block_table(2).unwrap(), &[1, 3, 4]);
    assert_eq!(m.num_pending_copy_ops(), 1);
    // ...when b is freed before the drain: the copy goes with it.
    m.free(2, &[]).unwrap();
    assert_eq!(m.num_pending_copy_ops(), 0);
    assert_eq!(m.ref_count(2).unwrap(), 0);
    m.check_invariants().unwrap();
    // Block 3 goes to the next request; a drain must not write into it.
    let c: Vec<u32> = (200..212).collect();
    admit_prompt(&mut m, 3, &c);
    assert!(m.block_table(3).unwrap().contains(&3));
    let mut ops = Vec::new();
    m.drain_copy_ops(&mut ops);
    assert!(ops.is_empty());
    m.check_invariants().unwrap();
}

#[test]
fn cancelling_follows_a_chain_of_copies_and_keeps_copies_someone_reads() {
    let mut m = mgr(8, 4, PrefixMode::Off);
    assert!(m.admit(1, 0, &[], &PrefixHit::default(), 6, 0).unwrap());
    m.fork(1, 2).unwrap();
    assert!(m.allocate_slots(2, 7).unwrap()); // op A: [2, 3]
    m.fork(2, 3).unwrap();
    assert!(m.allocate_slots(2, 8).unwrap()); // op B: [3, 4]; 3 is held by request 3 and B
    assert_eq!(m.block_table(2).unwrap(), &[1, 4]);
    // Request 3 reads block 3: freeing it keeps A, which B still needs.
    m.free(3, &[]).unwrap();
    assert_eq!(m.num_pending_copy_ops(), 2);
    m.check_invariants().unwrap();
    // Freeing 2 orphans B's destination, then A's (held only by B): both go.
    m.free(2, &[]).unwrap();
    assert_eq!(m.num_pending_copy_ops(), 0);
    assert_eq!(
        (1..5).map(|b| m.ref_count(b).unwrap()).collect::<Vec<_>>(),
        vec![1, 1, 0, 0]
    );
    m.check_invariants().unwrap();
    // A fork that still holds the destination keeps the copy.
    m.fork(1, 4).unwrap();
    assert!(m.allocate_slots(4, 7).unwrap());
    m.fork(4, 5).unwrap();
    m.free(4, &[]).unwrap();
    assert_eq!(m.num_pending_copy_ops(), 1);
    m.check_invariants().unwrap();
}

#[test]
fn a_pending_destination_is_not_cached_before_its_copy() {
    let mut m = mgr(8, 4, PrefixMode::Radix);
    let a: Vec<u32> = (0..8).collect();
    admit_prompt(&mut m, 1, &a);
    m.free(1, &a).unwrap();
    let b: Vec<u32> = (0..6).chain([50, 51, 52]).collect();
    admit_prompt(&mut m, 2, &b);
    m.cache_computed(2, &b[..8]).unwrap(); // block 3 waits for its copy
    assert_eq!(m.stats().cached_blocks, 2);
    m.check_invariants().unwrap();
    let mut ops = Vec::new();
    m.drain_copy_ops(&mut ops);
    m.cache_computed(2, &b[..8]).unwrap();
    assert_eq!(m.stats().cached_blocks, 3);
    m.check_invariants().unwrap();
}

#[test]
fn ids_and_namespaces_stop_below_2_pow_63() {
    let mut m = mgr(8, 4, PrefixMode::Radix);
    let none = PrefixHit::default();
    for (req, ns) in [(MAX_ID + 1, 0), (u64::MAX, 0), (1, MAX_ID + 1)] {
        assert!(matches!(
            m.admit(req, ns, &[1], &none, 1, 0),
            Err(KvError::InvalidArgument(_))
        ));
    }
    assert!(m.admit(MAX_ID, MAX_ID, &[1], &none, 1, 0).unwrap());
    assert!(matches!(
        m.fork(MAX_ID, MAX_ID + 1),
        Err(KvError::InvalidArgument(_))
    ));
    m.free(MAX_ID, &[1]).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn scheduler_ids_and_namespaces_stop_below_2_pow_63() {
    use crate::request::NewRequest;
    use crate::sched::{Scheduler, SchedulerConfig};
    let mut s = Scheduler::new(SchedulerConfig::new(64, 4)).unwrap();
    let req = |id, namespace| NewRequest {
        id,
        prompt: vec![1, 2, 3],
        max_tokens: 2,
        priority: 0,
        namespace,
        n: 1,
        ignore_eos: false,
        stop_token_ids: Vec::new(),
        retention: None,
    };
    for (id, ns) in [(MAX_ID + 1, 0), (u64::MAX, 0), (1, MAX_ID + 1)] {
        assert!(matches!(
            s.add_requests(vec![req(id, ns)]),
            Err(KvError::InvalidArgument(_))
        ));
    }
    s.add_requests(vec![req(MAX_ID, MAX_ID)]).unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.req_ids, vec![i64::MAX]);
    s.abort_requests(&[MAX_ID]).unwrap();
    s.check_invariants().unwrap();
}
