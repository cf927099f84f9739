//! Retention in the scheduler: scripted cases (exact window release, sinks + window, peaks) and
//! a property test over random workloads with random windows and policies: a released block is
//! never in a later plan's row of its sequence, what a row's queries can see is never released,
//! outputs equal the fake model's, and every block is back in the pool at the end.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::tests::{check_plan, drain, expected_output, fake_sample};
use super::*;
use crate::request::Retention;

fn cfg(num_blocks: u32, bs: u32, window: u32) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(num_blocks, bs);
    c.watermark = 0.0;
    c.sliding_window = window;
    c.max_num_batched_tokens = 8;
    c
}

/// Row `r` of group `g`'s block table (group 0: `block_table`).
fn group_row(p: &StepPlan, g: usize, r: usize, bs: usize) -> &[i32] {
    let nb = (p.seq_lens[r] as usize).div_ceil(bs);
    if g == 0 {
        return &p.block_table[r * p.max_blocks..r * p.max_blocks + nb];
    }
    let at = ((g - 1) * p.num_reqs() + r) * p.max_blocks;
    &p.group_block_table[at..at + nb]
}

/// Asserts that no block a row's first query may read is missing (null) in the plan.
fn check_visible(p: &StepPlan, r: usize, bs: usize, window: usize, ret: Option<Retention>) {
    check_visible_in(p, 0, r, bs, window, ret)
}

fn check_visible_in(
    p: &StepPlan,
    g: usize,
    r: usize,
    bs: usize,
    window: usize,
    ret: Option<Retention>,
) {
    let q0 = (p.seq_lens[r] - (p.query_start_loc[r + 1] - p.query_start_loc[r])) as usize;
    let row = group_row(p, g, r, bs);
    for (i, &b) in row.iter().enumerate() {
        let by_window = window > 0 && (i + 1) * bs <= q0 + 1 - window.min(q0 + 1);
        let by_policy = ret.is_some_and(|rt| {
            i >= rt.sink_blocks as usize && i + (rt.window_blocks as usize) < q0 / bs
        });
        if !(by_window || by_policy) {
            assert_ne!(b, 0, "row {r}: visible block {i} released (q0 {q0})");
        }
    }
}

#[test]
fn window_release_bounds_a_long_decode() {
    // Window 8 tokens, block 4: a decode at position c reads keys c-7..c, at most 3 blocks.
    let mut s = Scheduler::new(cfg(64, 4, 8)).unwrap();
    s.add_requests(vec![NewRequest::new(1, (1..=10).collect(), 40)])
        .unwrap();
    let mut out = HashMap::new();
    let mut peak_after_prefill = 0;
    while s.has_unfinished() {
        let p = super::tests::step(&mut s, &mut out);
        if p.num_reqs() == 1 {
            check_visible(&p, 0, 4, 8, None);
            let held = p.block_table.iter().filter(|&&b| b != 0).count();
            assert!(held <= 4, "held {held}");
        }
        peak_after_prefill = peak_after_prefill.max(s.stats().peak_seq_blocks);
    }
    let want = expected_output(&(1..=10).collect::<Vec<_>>(), 0, 40);
    assert_eq!(out[&(1, 0)].0, want);
    assert!(s.stats().num_released_blocks >= 9);
    assert!(peak_after_prefill <= 4);
    assert_eq!(s.kv().num_free_blocks(), 63);
}

#[test]
fn sinks_and_window_keep_their_blocks_and_close_publishing() {
    let mut s = Scheduler::new(cfg(64, 4, 0)).unwrap();
    let mut r = NewRequest::new(1, (1..=12).collect(), 30);
    r.retention = Some(Retention {
        sink_blocks: 1,
        window_blocks: 2,
    });
    let ret = r.retention;
    s.add_requests(vec![r]).unwrap();
    let mut out = HashMap::new();
    let mut steps = 0;
    while s.has_unfinished() {
        let p = super::tests::step(&mut s, &mut out);
        check_visible(&p, 0, 4, 0, ret);
        let nb = (p.seq_lens[0] as usize).div_ceil(4);
        if nb > 5 {
            let row = &p.block_table[..nb];
            assert_ne!(row[0], 0, "the sink stays");
            assert_eq!(row.iter().filter(|&&b| b != 0).count(), 4, "{row:?}");
        }
        steps += 1;
    }
    assert!(steps > 10);
    assert_eq!(out[&(1, 0)].1, FinishReason::Length);
    // Only the blocks completed before the first drop (at c = 16: blocks 0..4) are published.
    assert_eq!(s.kv().stats().cached_blocks, 4);
    assert_eq!(s.kv().num_free_blocks(), 63);
    assert!(matches!(
        Scheduler::new(cfg(64, 4, 0))
            .unwrap()
            .add_requests(vec![NewRequest {
                retention: Some(Retention {
                    sink_blocks: 1,
                    window_blocks: 0
                }),
                ..NewRequest::new(2, vec![1], 1)
            }]),
        Err(KvError::InvalidArgument(_))
    ));
}

#[test]
fn release_lets_more_sequences_run_at_once() {
    // 24 blocks of 4: without release 4 sequences of ~40 tokens preempt each other.
    let reqs = || {
        (0..4)
            .map(|i| NewRequest::new(i, (1..=8).map(|t| t + 100 * i as u32).collect(), 32))
            .collect::<Vec<_>>()
    };
    let mut full = Scheduler::new(cfg(24, 4, 0)).unwrap();
    full.add_requests(reqs()).unwrap();
    let a = drain(&mut full, 10_000);
    let mut win = Scheduler::new(cfg(24, 4, 8)).unwrap();
    win.add_requests(reqs()).unwrap();
    let b = drain(&mut win, 10_000);
    assert_eq!(
        a, b,
        "the fake model's outputs do not depend on the schedule"
    );
    assert!(full.stats().num_preemptions > 0);
    assert_eq!(win.stats().num_preemptions, 0);
    assert!(win.stats().peak_seq_blocks < full.stats().peak_seq_blocks);
}

fn check_group_slots(p: &StepPlan, bs: usize, groups: usize) {
    let n = p.num_tokens();
    assert_eq!(p.group_slot_mapping.len(), (groups - 1) * n);
    for g in 1..groups {
        for r in 0..p.num_reqs() {
            let row = group_row(p, g, r, bs);
            for t in p.query_start_loc[r] as usize..p.query_start_loc[r + 1] as usize {
                let pos = p.positions[t] as usize;
                let b = i64::from(row[pos / bs]);
                assert_ne!(b, 0, "group {g}: a token in the null block");
                assert_eq!(
                    p.group_slot_mapping[(g - 1) * n + t],
                    b * bs as i64 + (pos % bs) as i64
                );
            }
        }
    }
}

fn run(c: SchedulerConfig, reqs: Vec<NewRequest>, abort_at: Option<(usize, u64)>) {
    let mut s = Scheduler::new(c.clone()).unwrap();
    let bs = c.block_size as usize;
    let mut added = HashMap::new();
    for r in reqs {
        if s.add_requests(vec![r.clone()]).is_ok() {
            added.insert(r.id, r);
        }
    }
    // Per sequence (request, sample) and group: logical blocks seen released.
    let mut released: HashMap<(i64, i32, usize), HashSet<usize>> = HashMap::new();
    let groups = c.num_groups();
    let window = |g: usize| {
        if g == 0 {
            c.sliding_window as usize
        } else {
            c.group_windows[g - 1] as usize
        }
    };
    let mut preemptions = 0;
    let mut done = 0;
    for step in 0..5_000 {
        if !s.has_unfinished() {
            break;
        }
        if let Some((at, id)) = abort_at {
            if step == at && added.contains_key(&id) {
                done += s.abort_requests(&[id]).map(|f| f.len()).unwrap_or(0);
                added.remove(&id);
            }
        }
        let p = s.schedule().unwrap();
        check_plan(&s, &p);
        if s.stats().num_preemptions != preemptions {
            preemptions = s.stats().num_preemptions;
            released.clear(); // recompute: released blocks are computed again
        }
        check_group_slots(&p, bs, groups);
        let mut in_step = HashSet::new();
        for r in 0..p.num_reqs() {
            let ret = added[&(p.req_ids[r] as u64)].retention;
            for g in 0..groups {
                let key = (p.req_ids[r], p.seq_index[r], g);
                check_visible_in(&p, g, r, bs, window(g), ret);
                let row = group_row(&p, g, r, bs);
                let seen = released.entry(key).or_default();
                for &i in seen.iter() {
                    assert_eq!(row[i], 0, "{key:?}: released block {i} is back in a row");
                }
                seen.extend(
                    row.iter()
                        .enumerate()
                        .filter(|(_, &b)| b == 0)
                        .map(|(i, _)| i),
                );
                // A block this step writes belongs to one (request, group) only.
                let qs = p.query_start_loc[r] as usize..p.query_start_loc[r + 1] as usize;
                for t in qs {
                    in_step.insert((row[p.positions[t] as usize / bs], key));
                }
            }
        }
        let mut owner = HashMap::new();
        for (b, key) in in_step {
            if let Some(k) = owner.insert(b, key) {
                assert_eq!(k, key, "block {b} written by {k:?} and {key:?}");
            }
        }
        for f in s.update(p.step_id, &fake_sample(&p)).unwrap() {
            let r = &added[&f.req_id];
            if f.reason == FinishReason::Length {
                let want = expected_output(&r.prompt, f.seq_index, f.output.len());
                assert_eq!(f.output, want);
            }
            assert!(f.peak_blocks as usize <= s.kv().num_blocks() as usize);
            done += 1;
        }
        s.check_invariants().unwrap();
    }
    assert!(!s.has_unfinished(), "not drained");
    let expected: usize = added.values().map(|r| r.n as usize).sum();
    assert!(done >= expected);
    assert_eq!(s.kv().num_free_blocks(), c.num_blocks - 1);
}

fn request() -> impl Strategy<Value = (usize, u32, u32, bool, u32, u32, usize)> {
    (
        1usize..50,
        1u32..40,
        1u32..3,
        prop::bool::ANY,
        0u32..3,
        1u32..4,
        0usize..3,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn released_blocks_are_never_read_again(
        (num_blocks, bs, budget, thr) in (24u32..80, prop_oneof![Just(1u32), Just(2), Just(4)],
                                          1u32..24, 0u32..6),
        (window, mode) in (prop_oneof![Just(0u32), 1u32..24], 0usize..3),
        groups in prop::collection::vec(1u32..24, 0..3),
        reqs in prop::collection::vec(request(), 1..8),
        abort_at in proptest::option::of((0usize..40, 0u64..8)),
    ) {
        let mut c = SchedulerConfig::new(num_blocks, bs);
        c.max_num_batched_tokens = budget;
        c.long_prefill_token_threshold = thr;
        c.sliding_window = window;
        c.prefix_mode = [PrefixMode::Off, PrefixMode::Radix, PrefixMode::Hash][mode];
        c.max_model_len = 96;
        c.watermark = 0.0;
        if mode == 0 {
            c.group_windows = groups; // groups run without the prefix cache
        }
        let shared: Vec<u32> = (0..30).map(|i| 700 + i).collect();
        let reqs = reqs
            .into_iter()
            .enumerate()
            .map(|(i, (len, max_tokens, n, lossy, sink, win, pre))| {
                let mut p: Vec<u32> = shared[..pre * 10].to_vec();
                p.extend((0..len as u32).map(|t| 1000 * (i as u32 + 1) + t));
                let mut r = NewRequest::new(i as u64, p, max_tokens);
                r.n = n;
                r.ignore_eos = true;
                if lossy {
                    r.retention = Some(Retention { sink_blocks: sink, window_blocks: win });
                }
                r
            })
            .collect();
        run(c, reqs, abort_at);
    }
}

#[test]
fn a_hybrid_model_holds_its_global_group_and_a_window_per_local_group() {
    // Group 0 global (no window), groups 1 and 2 local with an 8-token window, blocks of 4.
    let mut c = cfg(128, 4, 0);
    c.prefix_mode = PrefixMode::Off;
    c.group_windows = vec![8, 8];
    let mut s = Scheduler::new(c).unwrap();
    s.add_requests(vec![NewRequest::new(1, (1..=10).collect(), 50)])
        .unwrap();
    let mut out = HashMap::new();
    while s.has_unfinished() {
        let p = super::tests::step(&mut s, &mut out);
        check_group_slots(&p, 4, 3);
        for g in 1..3 {
            check_visible_in(&p, g, 0, 4, 8, None);
            assert!(group_row(&p, g, 0, 4).iter().filter(|&&b| b != 0).count() <= 4);
        }
        assert!(
            group_row(&p, 0, 0, 4).iter().all(|&b| b != 0),
            "the global group keeps all"
        );
    }
    let want = expected_output(&(1..=10).collect::<Vec<_>>(), 0, 50);
    assert_eq!(out[&(1, 0)].0, want);
    // 59 tokens of KV: 15 global blocks + at most 4 (prefill: 3 + 1) per local group.
    assert!(
        s.stats().peak_seq_blocks <= 15 + 2 * 4,
        "{}",
        s.stats().peak_seq_blocks
    );
    assert_eq!(s.kv().num_free_blocks(), 127);
    let mut bad = cfg(128, 4, 0);
    bad.group_windows = vec![8]; // with the radix prefix cache
    assert!(matches!(
        Scheduler::new(bad),
        Err(KvError::InvalidArgument(_))
    ));
}

#[test]
fn caller_drops_go_back_through_update() {
    let mut s = Scheduler::new(cfg(64, 4, 0)).unwrap();
    s.add_requests(vec![NewRequest::new(1, (1..=16).collect(), 8)])
        .unwrap();
    let p = s.schedule().unwrap(); // 8 tokens: blocks 0, 1
    s.update(p.step_id, &fake_sample(&p)).unwrap();
    let p = s.schedule().unwrap(); // 8 more: blocks 2, 3 (written this step)
    let free = s.kv().num_free_blocks();
    let bad = s.update_with_drops(p.step_id, &fake_sample(&p), &[(0, 2)]);
    assert!(matches!(bad, Err(KvError::InvalidArgument(_))));
    assert!(matches!(
        s.update_with_drops(p.step_id, &fake_sample(&p), &[(1, 0)]),
        Err(KvError::InvalidArgument(_))
    ));
    assert_eq!(
        s.outstanding_step(),
        Some(p.step_id),
        "a refused drop changes nothing"
    );
    s.update_with_drops(p.step_id, &fake_sample(&p), &[(0, 1), (0, 1)])
        .unwrap();
    assert_eq!(s.kv().num_free_blocks(), free + 1);
    assert_eq!(s.stats().num_released_blocks, 1);
    let p = s.schedule().unwrap();
    assert_eq!(
        p.block_table[1], 0,
        "the dropped block is gone from the row"
    );
    s.update(p.step_id, &fake_sample(&p)).unwrap();
    let out = drain(&mut s, 100);
    assert_eq!(out[&(1, 0)].0.len(), 8);
    assert_eq!(s.kv().num_free_blocks(), 63);
}
