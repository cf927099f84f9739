//! Property tests: random configurations and random add / abort / step sequences, with
//! `check_invariants()` after every operation, every finished output checked against the fake
//! model, and every block back in the pool once all requests are done.

use std::collections::HashMap;

use proptest::prelude::*;

use super::tests::{check_plan, expected_output, fake_sample};
use super::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        len: usize,
        prefix: usize,
        max_tokens: u32,
        n: u32,
        priority: i32,
        ns: u64,
        stop: Option<u32>,
    },
    Abort(usize),
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1usize..40, 0usize..4, 1u32..24, 1u32..4, -2i32..3, 0u64..2, proptest::option::of(3u32..60))
            .prop_map(|(len, prefix, max_tokens, n, priority, ns, stop)| Op::Add {
                len, prefix, max_tokens, n, priority, ns, stop
            }),
        1 => (0usize..64).prop_map(Op::Abort),
        5 => Just(Op::Step),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        (
            8u32..48,
            prop_oneof![Just(1u32), Just(2), Just(4), Just(8)],
            1u32..48,
            1u32..8,
        ),
        (
            0u32..10,
            0u32..3,
            prop::bool::ANY,
            0usize..3,
            proptest::option::of(3u32..1000),
            24u32..80,
            prop::bool::weighted(0.75),
        ),
    )
        .prop_map(
            |((num_blocks, bs, budget, seqs), (thr, wm, prio, mode, eos, max_len, chunked))| {
                let mut c = SchedulerConfig::new(num_blocks, bs);
                c.max_num_batched_tokens = budget;
                c.max_num_seqs = seqs;
                c.long_prefill_token_threshold = thr;
                c.watermark = f64::from(wm) * 0.05;
                c.policy = if prio { Policy::Priority } else { Policy::Fcfs };
                c.prefix_mode = [PrefixMode::Off, PrefixMode::Radix, PrefixMode::Hash][mode];
                c.eos_token_id = eos;
                c.max_model_len = max_len;
                if !chunked {
                    // Whole prompts only: the budget must hold a whole sequence, no cap.
                    c.enable_chunked_prefill = false;
                    c.long_prefill_token_threshold = 0;
                    c.max_num_batched_tokens = budget.max(max_len);
                }
                c
            },
        )
}

/// Checks a finished sample against what the fake model generates for its request.
fn check_output(cfg: &SchedulerConfig, r: &NewRequest, f: &FinishedSeq) {
    let want = expected_output(&r.prompt, f.seq_index, f.output.len());
    assert_eq!(f.output, want, "request {} sample {}", r.id, f.seq_index);
    let stops =
        |t: u32| (!r.ignore_eos && cfg.eos_token_id == Some(t)) || r.stop_token_ids.contains(&t);
    let (last, before) = f.output.split_last().expect("a finished sample has output");
    assert!(!before.iter().any(|&t| stops(t)), "ran past a stop token");
    match f.reason {
        FinishReason::Stop => assert!(stops(*last)),
        FinishReason::Length => assert!(
            f.output.len() == r.max_tokens as usize
                || r.prompt.len() + f.output.len() == cfg.max_model_len as usize
        ),
        FinishReason::Abort => unreachable!(),
    }
}

fn run(cfg: SchedulerConfig, ops: Vec<Op>) {
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let prefixes: Vec<Vec<u32>> = (0..4)
        .map(|p| (0..20).map(|i| 5000 + p * 100 + i).collect())
        .collect();
    let mut added: HashMap<u64, NewRequest> = HashMap::new();
    let mut done: HashMap<(u64, u32), FinishedSeq> = HashMap::new();
    let record =
        |added: &HashMap<u64, NewRequest>, done: &mut HashMap<_, _>, fs: Vec<FinishedSeq>| {
            for f in fs {
                if f.reason != FinishReason::Abort {
                    check_output(&cfg, &added[&f.req_id], &f);
                }
                assert!(done.insert((f.req_id, f.seq_index), f).is_none());
            }
        };
    let mut next_id = 0u64;
    for op in ops {
        match op {
            Op::Add {
                len,
                prefix,
                max_tokens,
                n,
                priority,
                ns,
                stop,
            } => {
                let mut prompt: Vec<u32> = prefixes[prefix][..len.min(20)].to_vec();
                prompt.extend(
                    (0..len.saturating_sub(20) as u32).map(|i| 9000 + next_id as u32 * 50 + i),
                );
                let mut r = NewRequest::new(next_id, prompt, max_tokens);
                (r.n, r.priority, r.namespace) = (n, priority, ns);
                r.stop_token_ids = stop.into_iter().collect();
                r.ignore_eos = next_id % 3 == 0;
                let before = s.stats().num_requests;
                match s.add_requests(vec![r.clone()]) {
                    Ok(()) => {
                        added.insert(next_id, r);
                    }
                    Err(KvError::TooLong(_) | KvError::InvalidArgument(_)) => {
                        assert_eq!(s.stats().num_requests, before)
                    }
                    Err(e) => panic!("unexpected {e}"),
                }
                next_id += 1;
            }
            Op::Abort(pick) => {
                let mut live: Vec<u64> = added
                    .keys()
                    .copied()
                    .filter(|id| {
                        let n = added[id].n;
                        (0..n).any(|k| !done.contains_key(&(*id, k)))
                    })
                    .collect();
                live.sort_unstable();
                if let Some(&id) = live.get(pick % live.len().max(1)) {
                    let fs = s.abort_requests(&[id]).unwrap();
                    assert!(fs.iter().all(|f| f.reason == FinishReason::Abort));
                    record(&added, &mut done, fs);
                }
            }
            Op::Step => {
                let p = s.schedule().unwrap();
                check_plan(&s, &p);
                let fs = s.update(p.step_id, &fake_sample(&p)).unwrap();
                record(&added, &mut done, fs);
            }
        }
        s.check_invariants().unwrap();
    }
    let mut steps = 0;
    while s.has_unfinished() {
        let p = s.schedule().unwrap();
        check_plan(&s, &p);
        let fs = s.update(p.step_id, &fake_sample(&p)).unwrap();
        record(&added, &mut done, fs);
        s.check_invariants().unwrap();
        steps += 1;
        assert!(steps < 20_000, "not drained");
    }
    // Every sample of every accepted request is reported exactly once, and the pool is whole.
    let expected: usize = added.values().map(|r| r.n as usize).sum();
    assert_eq!(done.len(), expected);
    assert_eq!(s.kv().num_free_blocks(), cfg.num_blocks - 1);
    assert_eq!(s.kv().usage(), 0.0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_operation_sequences(cfg in config(), ops in prop::collection::vec(op(), 1..80)) {
        run(cfg, ops);
    }
}
