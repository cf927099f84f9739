//! Scripted scheduler scenarios with exact expectations (chunk sizes, row order, who is
//! preempted, outputs equal to an unpreempted run), and the refusal of bad input.

use std::collections::HashMap;

use super::*;

/// The fake model: the next token depends only on the last token, its position and the sample
/// index, so any schedule (chunked, preempted, forked) must produce the same outputs.
pub(super) fn next_token(last: u32, pos: usize, sample: u32) -> u32 {
    ((u64::from(last) * 31 + pos as u64 * 7 + u64::from(sample) * 13) % 997) as u32 + 3
}

/// Samples every logits row of a plan with the fake model.
pub(super) fn fake_sample(p: &StepPlan) -> Vec<u32> {
    (0..p.num_sampled())
        .map(|k| {
            let t = p.logits_indices[k] as usize;
            next_token(
                p.input_ids[t] as u32,
                p.positions[t] as usize,
                p.sample_seq_index[k] as u32,
            )
        })
        .collect()
}

/// What the fake model generates for `prompt` as sample `sample` (stop ids and EOS ignored).
pub(super) fn expected_output(prompt: &[u32], sample: u32, len: usize) -> Vec<u32> {
    let mut toks = prompt.to_vec();
    for _ in 0..len {
        let pos = toks.len() - 1;
        toks.push(next_token(*toks.last().unwrap(), pos, sample));
    }
    toks[prompt.len()..].to_vec()
}

type Outputs = HashMap<(u64, u32), (Vec<u32>, FinishReason)>;

/// One step with the fake model; checks invariants before returning.
pub(super) fn step(s: &mut Scheduler, out: &mut Outputs) -> StepPlan {
    let p = s.schedule().unwrap();
    check_plan(s, &p);
    let sampled = fake_sample(&p);
    for f in s.update(p.step_id, &sampled).unwrap() {
        assert!(out
            .insert((f.req_id, f.seq_index), (f.output, f.reason))
            .is_none());
    }
    s.check_invariants().unwrap();
    p
}

/// Steps until every request finished (at most `limit` steps).
pub(super) fn drain(s: &mut Scheduler, limit: usize) -> Outputs {
    let mut out = Outputs::new();
    for _ in 0..limit {
        if !s.has_unfinished() {
            return out;
        }
        step(s, &mut out);
    }
    panic!("not drained after {limit} steps");
}

/// Structural checks of a plan: offsets, positions, slots against the block tables.
pub(super) fn check_plan(s: &Scheduler, p: &StepPlan) {
    let bs = s.config().block_size as i64;
    let n = p.num_reqs();
    assert_eq!(p.query_start_loc.len(), n + 1);
    assert_eq!(p.block_table.len(), n * p.max_blocks);
    assert_eq!(p.num_decode + p.num_prefill, n);
    assert!(p.num_tokens() <= s.config().max_num_batched_tokens as usize);
    for r in 0..n {
        let (a, b) = (
            p.query_start_loc[r] as usize,
            p.query_start_loc[r + 1] as usize,
        );
        assert_eq!(b - a == 1, r < p.num_decode, "decode rows first");
        assert_eq!(p.positions[b - 1] + 1, i64::from(p.seq_lens[r]));
        for t in a..b {
            let pos = p.positions[t];
            if t > a {
                assert_eq!(pos, p.positions[t - 1] + 1);
            }
            let block = i64::from(p.block_table[r * p.max_blocks + (pos / bs) as usize]);
            assert_ne!(block, 0, "a token in the null block");
            assert_eq!(p.slot_mapping[t], block * bs + pos % bs);
        }
    }
    for k in 0..p.num_sampled() {
        let r = p.sample_rows[k] as usize;
        assert_eq!(p.logits_indices[k], i64::from(p.query_start_loc[r + 1]) - 1);
        assert_eq!(p.sample_req_ids[k], p.req_ids[r]);
    }
}

fn cfg(num_blocks: u32, block_size: u32, budget: u32) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(num_blocks, block_size);
    c.max_num_batched_tokens = budget;
    c.watermark = 0.0;
    c
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i + 1).collect()
}

fn chunks(p: &StepPlan) -> Vec<(i64, i32)> {
    (0..p.num_reqs())
        .map(|r| {
            (
                p.req_ids[r],
                p.query_start_loc[r + 1] - p.query_start_loc[r],
            )
        })
        .collect()
}

#[test]
fn chunked_prefill_then_decode() {
    let mut s = Scheduler::new(cfg(64, 4, 8)).unwrap();
    s.add_requests(vec![NewRequest::new(7, prompt(20, 1), 3)])
        .unwrap();
    let mut out = Outputs::new();
    let p1 = step(&mut s, &mut out);
    assert_eq!(
        (chunks(&p1), p1.num_sampled(), p1.seq_lens.clone()),
        (vec![(7, 8)], 0, vec![8])
    );
    assert_eq!(p1.positions, (0..8).collect::<Vec<i64>>());
    let p2 = step(&mut s, &mut out);
    assert_eq!((chunks(&p2), p2.num_sampled()), (vec![(7, 8)], 0));
    let p3 = step(&mut s, &mut out);
    assert_eq!(
        (chunks(&p3), p3.logits_indices.clone()),
        (vec![(7, 4)], vec![3])
    );
    assert_eq!((p3.seq_lens.clone(), p3.num_prefill), (vec![20], 1));
    let p4 = step(&mut s, &mut out);
    assert_eq!(
        (chunks(&p4), p4.positions.clone(), p4.num_decode),
        (vec![(7, 1)], vec![20], 1)
    );
    step(&mut s, &mut out);
    assert!(!s.has_unfinished());
    assert_eq!(
        out[&(7, 0)],
        (expected_output(&prompt(20, 1), 0, 3), FinishReason::Length)
    );
    assert_eq!(s.stats().num_steps, 5);
    assert_eq!(s.kv().num_free_blocks(), 63);
}

#[test]
fn decodes_first_then_prefill_chunks_then_admission() {
    let mut c = cfg(64, 4, 6);
    c.long_prefill_token_threshold = 4;
    let mut s = Scheduler::new(c).unwrap();
    let mut out = Outputs::new();
    s.add_requests(vec![NewRequest::new(1, prompt(3, 1), 10)])
        .unwrap();
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(1, 3)]);
    s.add_requests(vec![
        NewRequest::new(2, prompt(9, 2), 10),
        NewRequest::new(3, prompt(5, 3), 10),
    ])
    .unwrap();
    // 1 decodes, 2 is admitted with a chunk capped at 4, 3 gets the last budget token.
    assert_eq!(
        chunks(&step(&mut s, &mut out)),
        vec![(1, 1), (3, 1), (2, 4)]
    );
    // Decode (1), then running prefills in arrival order: 2 gets 4 (the cap), 3 the last
    // token of the budget; a one-token chunk is laid out with the decodes.
    let p = step(&mut s, &mut out);
    assert_eq!(
        (chunks(&p), p.num_decode),
        (vec![(1, 1), (3, 1), (2, 4)], 2)
    );
    assert_eq!(p.num_sampled(), 1);
    // 2 has one prompt token left, so it is served in the decode pass, before 3's chunk.
    let p = step(&mut s, &mut out);
    assert_eq!(chunks(&p), vec![(1, 1), (2, 1), (3, 3)]);
    assert_eq!(p.sample_req_ids, vec![1, 2, 3]);
}

#[test]
fn max_num_seqs_caps_admission() {
    let mut c = cfg(64, 4, 100);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c).unwrap();
    let reqs = (0..3)
        .map(|i| NewRequest::new(i, prompt(4, i as u32), 2))
        .collect();
    s.add_requests(reqs).unwrap();
    let mut out = Outputs::new();
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(0, 4), (1, 4)]);
    assert_eq!(s.stats().num_waiting, 1);
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(0, 1), (1, 1)]);
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(2, 4)]);
}

#[test]
fn without_chunked_prefill_prompts_are_computed_whole() {
    let mut c = cfg(64, 4, 16);
    c.max_model_len = 16;
    c.enable_chunked_prefill = false;
    let mut s = Scheduler::new(c).unwrap();
    s.add_requests(vec![
        NewRequest::new(0, prompt(10, 0), 3),
        NewRequest::new(1, prompt(10, 1), 3),
    ])
    .unwrap();
    let mut out = Outputs::new();
    // 16 tokens of budget: request 1's 10 do not fit beside request 0's, so it waits whole.
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(0, 10)]);
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(0, 1), (1, 10)]);
    out.extend(drain(&mut s, 10));
    assert_eq!(out[&(1, 0)].0, expected_output(&prompt(10, 1), 0, 3));
    // The same workload chunked: request 1 starts at once with the 6 tokens left.
    let mut s = Scheduler::new(cfg(64, 4, 16)).unwrap();
    s.add_requests(vec![
        NewRequest::new(0, prompt(10, 0), 3),
        NewRequest::new(1, prompt(10, 1), 3),
    ])
    .unwrap();
    assert_eq!(
        chunks(&step(&mut s, &mut Outputs::new())),
        vec![(0, 10), (1, 6)]
    );
}

#[test]
fn without_chunked_prefill_the_budget_must_hold_a_whole_sequence() {
    let mut c = cfg(64, 4, 16);
    c.enable_chunked_prefill = false;
    c.max_model_len = 17;
    assert!(matches!(
        Scheduler::new(c.clone()),
        Err(KvError::InvalidArgument(_))
    ));
    c.max_model_len = 16;
    c.long_prefill_token_threshold = 8;
    assert!(matches!(
        Scheduler::new(c.clone()),
        Err(KvError::InvalidArgument(_))
    ));
    c.long_prefill_token_threshold = 0;
    assert!(Scheduler::new(c).is_ok());
}

#[test]
fn blocked_queue_head_counts_one_prefix_query() {
    // 6 usable blocks of 4: request 0 holds 4 of them (growing to 5), request 1 needs 3, so
    // it waits several steps; its repeated lookups count as one query, made when admitted.
    let mut s = Scheduler::new(cfg(7, 4, 100)).unwrap();
    s.add_requests(vec![
        NewRequest::new(0, prompt(16, 0), 4),
        NewRequest::new(1, prompt(12, 1), 2),
    ])
    .unwrap();
    let mut out = Outputs::new();
    for _ in 0..3 {
        step(&mut s, &mut out);
        assert_eq!(s.stats().prefix_queries, 1);
    }
    out.extend(drain(&mut s, 20));
    let st = s.stats();
    assert_eq!((st.prefix_queries, st.prefix_query_tokens), (2, 28));
}

/// Two requests outgrow a small pool: the later arrival is preempted, recomputed, and both
/// outputs equal those of a run in a big pool.
#[test]
fn preemption_recomputes_to_identical_output() {
    let reqs = || {
        vec![
            NewRequest::new(10, prompt(6, 1), 14),
            NewRequest::new(11, prompt(6, 2), 14),
        ]
    };
    let mut big = Scheduler::new(cfg(64, 4, 64)).unwrap();
    big.add_requests(reqs()).unwrap();
    let reference = drain(&mut big, 100);
    assert_eq!(big.stats().num_preemptions, 0);

    // 8 usable blocks: each request needs ceil(19/4) = 5 at the end, so both cannot finish.
    let mut s = Scheduler::new(cfg(9, 4, 64)).unwrap();
    s.add_requests(reqs()).unwrap();
    let mut out = Outputs::new();
    let mut preempted_at = None;
    for i in 0..100 {
        if !s.has_unfinished() {
            break;
        }
        let before = s.stats().num_preemptions;
        let p = step(&mut s, &mut out);
        if preempted_at.is_none() && s.stats().num_preemptions > before {
            preempted_at = Some(i);
            // Request 10 (earlier arrival) keeps running alone; 11 waits at the head.
            assert_eq!(chunks(&p), vec![(10, 1)]);
            assert_eq!((s.stats().num_running, s.stats().num_waiting), (1, 1));
        }
    }
    assert!(preempted_at.is_some());
    assert_eq!(out, reference);
    assert_eq!(s.kv().num_free_blocks(), 8);
}

#[test]
fn priority_policy_preempts_lowest_priority_first() {
    let mut c = cfg(9, 4, 64);
    c.policy = Policy::Priority;
    let mut s = Scheduler::new(c).unwrap();
    let mut a = NewRequest::new(1, prompt(6, 1), 14);
    a.priority = 5; // arrives first but is less important
    let mut b = NewRequest::new(2, prompt(6, 2), 14);
    b.priority = -1;
    s.add_requests(vec![a, b]).unwrap();
    let mut out = Outputs::new();
    // Service order puts 2 first even though 1 arrived first.
    assert_eq!(chunks(&step(&mut s, &mut out)), vec![(2, 6), (1, 6)]);
    while s.stats().num_preemptions == 0 {
        step(&mut s, &mut out);
    }
    assert_eq!(s.stats().num_running, 1);
    let p = step(&mut s, &mut out);
    assert_eq!(p.req_ids, vec![2]);
    drain(&mut s, 100);
    assert_eq!(s.kv().num_free_blocks(), 8);
}

#[test]
fn fcfs_ignores_priority() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut a = NewRequest::new(1, prompt(3, 1), 2);
    a.priority = 9;
    let b = NewRequest::new(2, prompt(3, 2), 2);
    s.add_requests(vec![a, b]).unwrap();
    assert_eq!(
        chunks(&step(&mut s, &mut Outputs::new())),
        vec![(1, 3), (2, 3)]
    );
}

#[test]
fn prefix_hit_skips_cached_tokens() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let shared = prompt(13, 5);
    s.add_requests(vec![NewRequest::new(1, shared.clone(), 1)])
        .unwrap();
    drain(&mut s, 10);
    let mut other = shared[..12].to_vec();
    other.extend([77, 78]);
    s.add_requests(vec![NewRequest::new(2, other.clone(), 2)])
        .unwrap();
    let mut out = Outputs::new();
    let p = step(&mut s, &mut out);
    // 12 of 14 tokens were cached (3 full blocks): only 2 are computed.
    assert_eq!(
        (chunks(&p), p.positions.clone()),
        (vec![(2, 2)], vec![12, 13])
    );
    let st = s.stats();
    assert_eq!((st.prefix_queries, st.prefix_hit_tokens), (2, 12));
    out.extend(drain(&mut s, 10));
    assert_eq!(out[&(2, 0)].0, expected_output(&other, 0, 2));
}

#[test]
fn namespaces_do_not_share_prefixes() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    s.add_requests(vec![NewRequest::new(1, prompt(9, 5), 1)])
        .unwrap();
    drain(&mut s, 10);
    let mut r = NewRequest::new(2, prompt(9, 5), 1);
    r.namespace = 3;
    s.add_requests(vec![r]).unwrap();
    let p = step(&mut s, &mut Outputs::new());
    assert_eq!(chunks(&p), vec![(2, 9)]);
}

#[test]
fn parallel_samples_fork_with_copy_on_write() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut r = NewRequest::new(5, prompt(6, 1), 4);
    r.n = 3;
    s.add_requests(vec![r]).unwrap();
    let mut out = Outputs::new();
    let p = step(&mut s, &mut out);
    // One prefill row, its last logits sampled three times (samples 0, 1, 2).
    assert_eq!(
        (chunks(&p), p.logits_indices.clone()),
        (vec![(5, 6)], vec![5, 5, 5])
    );
    assert_eq!(p.sample_seq_index, vec![0, 1, 2]);
    assert_eq!(s.stats().num_running, 3);
    let p = step(&mut s, &mut out);
    assert_eq!(p.seq_index, vec![0, 1, 2]);
    // Position 6 lands in the shared partial block 1: samples 0 and 1 copy it (copy-on-write),
    // sample 2, its last holder, writes it in place.
    let table = |r: usize| &p.block_table[r * p.max_blocks..(r + 1) * p.max_blocks];
    let shared = table(2)[1];
    assert_eq!(p.copy_ops, vec![shared, table(0)[1], shared, table(1)[1]]);
    assert!(table(0)[0] == table(1)[0] && table(1)[0] == table(2)[0]);
    assert!(table(0)[1] != table(1)[1] && table(0)[1] != shared && table(1)[1] != shared);
    let outs = drain(&mut s, 20);
    out.extend(outs);
    for k in 0..3 {
        assert_eq!(
            out[&(5, k)],
            (expected_output(&prompt(6, 1), k, 4), FinishReason::Length)
        );
    }
    assert_eq!(s.kv().num_free_blocks(), 63);
}

#[test]
fn stop_tokens_eos_and_model_length() {
    let first = next_token(prompt(4, 1)[3], 3, 0);
    let mut c = cfg(64, 4, 64);
    c.eos_token_id = Some(first);
    c.max_model_len = 7;
    let mut s = Scheduler::new(c).unwrap();
    let a = NewRequest::new(1, prompt(4, 1), 10); // stops on EOS at once
    let mut b = NewRequest::new(2, prompt(4, 1), 10);
    b.ignore_eos = true; // runs to max_model_len: 3 output tokens
    let mut d = NewRequest::new(3, prompt(4, 1), 10);
    d.ignore_eos = true;
    d.stop_token_ids = vec![expected_output(&prompt(4, 1), 0, 2)[1]];
    s.add_requests(vec![a, b, d]).unwrap();
    let out = drain(&mut s, 10);
    assert_eq!(out[&(1, 0)], (vec![first], FinishReason::Stop));
    assert_eq!(
        out[&(2, 0)],
        (expected_output(&prompt(4, 1), 0, 3), FinishReason::Length)
    );
    assert_eq!(
        out[&(3, 0)],
        (expected_output(&prompt(4, 1), 0, 2), FinishReason::Stop)
    );
}

#[test]
fn abort_between_schedule_and_update() {
    let mut s = Scheduler::new(cfg(64, 4, 64)).unwrap();
    let mut r = NewRequest::new(1, prompt(5, 1), 8);
    r.n = 2;
    s.add_requests(vec![r, NewRequest::new(2, prompt(5, 2), 8)])
        .unwrap();
    let p = s.schedule().unwrap();
    let aborted = s.abort_requests(&[1, 1]).unwrap();
    assert_eq!(aborted.len(), 2); // samples 0 and the pending fork 1
    assert!(aborted
        .iter()
        .all(|f| f.reason == FinishReason::Abort && f.output.is_empty()));
    assert_eq!(
        aborted.iter().map(|f| f.request_done).collect::<Vec<_>>(),
        vec![false, true]
    );
    // A new request may reuse the slab slot before the update; the stale row is skipped.
    s.add_requests(vec![NewRequest::new(3, prompt(5, 3), 1)])
        .unwrap();
    let fin = s.update(p.step_id, &fake_sample(&p)).unwrap();
    assert!(fin.is_empty());
    s.check_invariants().unwrap();
    let out = drain(&mut s, 20);
    assert_eq!(out.len(), 2);
    assert_eq!(s.kv().num_free_blocks(), 63);
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    s.add_requests(vec![NewRequest::new(1, prompt(5, 1), 4)])
        .unwrap();
    let dup = vec![
        NewRequest::new(2, prompt(2, 1), 1),
        NewRequest::new(1, prompt(2, 1), 1),
    ];
    assert_eq!(s.add_requests(dup), Err(KvError::DuplicateRequest(1)));
    let dup = vec![
        NewRequest::new(3, prompt(2, 1), 1),
        NewRequest::new(3, prompt(2, 1), 1),
    ];
    assert_eq!(s.add_requests(dup), Err(KvError::DuplicateRequest(3)));
    assert!(matches!(
        s.add_requests(vec![NewRequest::new(4, vec![], 1)]),
        Err(KvError::InvalidArgument(_))
    ));
    // 15 usable blocks of 4 tokens: a run needing 61 tokens of KV can never fit.
    assert!(matches!(
        s.add_requests(vec![NewRequest::new(4, prompt(30, 1), 32)]),
        Err(KvError::TooLong(_))
    ));
    assert!(matches!(
        s.add_requests(vec![NewRequest::new(4, prompt(8192, 1), 1)]),
        Err(KvError::TooLong(_))
    ));
    let mut wide = NewRequest::new(4, prompt(2, 1), 1);
    wide.n = 1000;
    assert!(matches!(
        s.add_requests(vec![wide]),
        Err(KvError::InvalidArgument(_))
    ));
    assert_eq!(s.stats().num_requests, 1);
    assert_eq!(s.abort_requests(&[1, 99]), Err(KvError::UnknownRequest(99)));
    assert_eq!(s.stats().num_requests, 1);
    assert_eq!(s.update(1, &[]), Err(KvError::NoStepOutstanding { got: 1 }));
    let p = s.schedule().unwrap();
    assert!(matches!(s.schedule(), Err(KvError::InvalidArgument(_))));
    assert_eq!(
        s.update(p.step_id + 1, &[5]),
        Err(KvError::StaleStep {
            expected: 1,
            got: 2
        })
    );
    assert!(matches!(
        s.update(p.step_id, &[5, 6]),
        Err(KvError::InvalidArgument(_))
    ));
    assert!(matches!(
        s.update(p.step_id, &[]),
        Err(KvError::InvalidArgument(_))
    ));
    s.check_invariants().unwrap();
    assert_eq!(s.update(p.step_id, &[5]).unwrap(), vec![]);
    assert_eq!(
        s.update(p.step_id, &[5]),
        Err(KvError::NoStepOutstanding { got: 1 })
    );
    let st = s.stats();
    assert_eq!(
        (st.num_running, st.num_steps, st.num_computed_tokens),
        (1, 1, 5)
    );
    s.check_invariants().unwrap();
}

#[test]
fn empty_steps_are_steps_too() {
    let mut s = Scheduler::new(cfg(16, 4, 64)).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(
        (p.num_reqs(), p.max_blocks, p.query_start_loc.clone()),
        (0, 0, vec![0])
    );
    assert!(s.update(p.step_id, &[]).unwrap().is_empty());
}

#[test]
fn watermark_holds_back_admission_only() {
    let mut c = cfg(11, 4, 64); // 10 usable blocks
    c.watermark = 0.3; // 4 blocks kept free at admission
    let mut s = Scheduler::new(c).unwrap();
    let reqs = (0..3)
        .map(|i| NewRequest::new(i, prompt(8, i as u32), 4))
        .collect();
    s.add_requests(reqs).unwrap();
    // Each first chunk takes 2 blocks: 10 - 2 = 8 >= 4, 8 - 2 = 6 >= 4, 6 - 2 = 4 >= 4.
    assert_eq!(step(&mut s, &mut Outputs::new()).num_reqs(), 3);
    let mut c = cfg(11, 4, 64);
    c.watermark = 0.4; // 5 blocks: the third admission would leave 4
    let mut s = Scheduler::new(c).unwrap();
    let reqs = (0..3)
        .map(|i| NewRequest::new(i, prompt(8, i as u32), 4))
        .collect();
    s.add_requests(reqs).unwrap();
    assert_eq!(step(&mut s, &mut Outputs::new()).num_reqs(), 2);
}
