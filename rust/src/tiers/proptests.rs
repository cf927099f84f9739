//! Property test of the tier state machine, end to end through the scheduler: a simulated KV
//! store (every L1 token slot, L2 slot and shared-store value holds the `(position, token)` it
//! was computed for) applies each StepPlan's moves in the runner's order, then checks that every
//! block a scheduled row reads holds exactly that row's tokens. Random pools small enough to
//! evict and preempt constantly, random L2 sizes, swap/recompute/auto preemption, an L3/L4 stand-in
//! (written through by offloads and publishes, read by fetches that randomly come back short), and
//! aborts. After every operation the scheduler's and the tiers' invariants hold (no slot lost or
//! owned twice); at the end every request finished and every block and private slot is back.

use std::collections::HashMap;

use proptest::prelude::*;

use super::{BlockKey, Preemption, TierConfig};
use crate::prefix::radix::{NO_BLOCK, NO_SLOT};
use crate::prefix::PrefixMode;
use crate::request::{FinishReason, NewRequest};
use crate::sched::{Scheduler, SchedulerConfig, StepPlan};

type Kv = Option<(u32, u32)>;

struct Sim {
    bs: usize,
    l1: Vec<Kv>,
    l2: Vec<Kv>,
    store: HashMap<BlockKey, Vec<Kv>>,
    tokens: HashMap<u64, Vec<u32>>,
    ns: HashMap<u64, u64>,
}

impl Sim {
    fn block(v: &[Kv], b: usize, bs: usize) -> Vec<Kv> {
        v[b * bs..(b + 1) * bs].to_vec()
    }

    /// Applies `p`'s moves in the model runner's order, checks what each row reads, writes
    /// the step's KV.
    fn apply(&mut self, p: &StepPlan) {
        let bs = self.bs;
        let t = &p.tiers;
        for (i, &b) in t.publish.iter().enumerate() {
            let kv = Self::block(&self.l1, b as usize, bs);
            self.store.insert(t.publish_keys[i], kv);
        }
        for (i, op) in t.offload.iter().enumerate() {
            let kv = Self::block(&self.l1, op[0] as usize, bs);
            self.l2[op[1] as usize * bs..(op[1] as usize + 1) * bs].copy_from_slice(&kv);
            if t.offload_kind[i] == super::state::OFFLOAD_CACHED {
                self.store.insert(t.offload_keys[i], kv);
            }
        }
        for op in &t.load {
            let kv = Self::block(&self.l2, op[0] as usize, bs);
            self.l1[op[1] as usize * bs..(op[1] as usize + 1) * bs].copy_from_slice(&kv);
        }
        for op in p.copy_ops.chunks_exact(2) {
            let kv = Self::block(&self.l1, op[0] as usize, bs);
            self.l1[op[1] as usize * bs..(op[1] as usize + 1) * bs].copy_from_slice(&kv);
        }
        for r in 0..p.num_reqs() {
            let toks = &self.tokens[&(p.req_ids[r] as u64)];
            let q0 = p.query_start_loc[r] as usize;
            let start = p.positions[q0] as usize;
            for (pos, &tok) in toks.iter().enumerate().take(start) {
                let b = p.block_table[r * p.max_blocks + pos / bs] as usize;
                let got = self.l1[b * bs + pos % bs];
                assert_eq!(got, Some((pos as u32, tok)), "row {r} reads position {pos}");
            }
            for q in q0..p.query_start_loc[r + 1] as usize {
                let pos = p.positions[q] as usize;
                assert_eq!(p.input_ids[q], i64::from(toks[pos]));
                self.l1[p.slot_mapping[q] as usize] = Some((pos as u32, toks[pos]));
            }
        }
    }

    /// Serves the plan's fetches from the store: the leading keys found, cut short at random.
    fn fetch(&mut self, s: &mut Scheduler, p: &StepPlan, short: usize) {
        let (t, bs) = (&p.tiers, self.bs);
        let mut counts = Vec::new();
        for i in 0..t.fetch_seqs.len() {
            let keys = &t.fetch_keys[t.fetch_offsets[i] as usize..t.fetch_offsets[i + 1] as usize];
            let n = keys
                .iter()
                .take_while(|k| self.store.contains_key(*k))
                .count();
            counts.push(n.saturating_sub(short % 3));
        }
        let (offsets, slots) = s.tier_fetched(&t.fetch_seqs, &counts).unwrap();
        for i in 0..t.fetch_seqs.len() {
            let base = t.fetch_offsets[i] as usize;
            for (j, &slot) in slots[offsets[i] as usize..offsets[i + 1] as usize]
                .iter()
                .enumerate()
            {
                if slot != u32::MAX {
                    let kv = self.store[&t.fetch_keys[base + j]].clone();
                    self.l2[slot as usize * bs..(slot as usize + 1) * bs].copy_from_slice(&kv);
                }
            }
        }
    }
}

/// The prefix cache's tier entries against the tiers, the simulated KV and a brute force:
/// every entry's L1 block and L2 slot hold its path's KV, and the walk's per-tier counts for
/// every live sequence equal a recount entry by entry.
fn check_tree(s: &mut Scheduler, sim: &Sim, live: &[u64]) {
    let bs = sim.bs;
    s.kv().check_tier_refs().unwrap();
    for (_, path, b, slot) in s.kv().tier_entries() {
        let k = path.len() - bs;
        let want: Vec<Kv> = (k..path.len()).map(|p| Some((p as u32, path[p]))).collect();
        if b != NO_BLOCK {
            assert_eq!(Sim::block(&sim.l1, b as usize, bs), want, "L1 block {b}");
        }
        if slot != NO_SLOT {
            assert_eq!(
                Sim::block(&sim.l2, slot as usize, bs),
                want,
                "L2 slot {slot}"
            );
        }
    }
    for id in live {
        let (toks, ns) = (&sim.tokens[id], sim.ns[id]);
        let max = toks.len() - 1;
        let (n, l1, l2) = s.kv_mut().lookup_counts(ns, toks, max);
        let (k1, slots) = s.kv_mut().brute_counts(ns, toks, max);
        assert_eq!(
            (n / bs, &l2),
            (k1, &slots),
            "walk vs brute force, request {id}"
        );
        assert_eq!(l1.len(), n.div_ceil(bs));
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: usize,
        len: usize,
        max_tokens: u32,
        ns: u64,
    },
    Abort(usize),
    Step(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4, 1usize..40, 1u32..12, 0u64..2)
            .prop_map(|(prefix, len, max_tokens, ns)| Op::Add { prefix, len, max_tokens, ns }),
        1 => (0usize..64).prop_map(Op::Abort),
        6 => (0usize..8).prop_map(Op::Step),
    ]
}

fn sample(id: u64, len: usize) -> u32 {
    (id as u32 * 31 + len as u32 * 7) % 97 + 2000
}

fn run(
    num_blocks: u32,
    bs: u32,
    host: u32,
    mode: usize,
    budget: u32,
    ops: Vec<Op>,
    prefix: PrefixMode,
) -> super::TierStats {
    let mut cfg = SchedulerConfig::new(num_blocks, bs);
    cfg.prefix_mode = prefix;
    cfg.max_num_batched_tokens = budget;
    cfg.watermark = 0.0;
    cfg.max_model_len = 64;
    let mut tc = TierConfig::new(host);
    tc.preemption = [Preemption::Recompute, Preemption::Swap, Preemption::Auto][mode % 3];
    (tc.fetch, tc.publish) = (mode >= 3, mode >= 3);
    (
        tc.bytes_per_block,
        tc.copy_bytes_per_s,
        tc.seconds_per_token,
    ) = (100, 1e6, 1e-5);
    cfg.tiers = Some(tc);
    let mut s = Scheduler::new(cfg).unwrap();
    let bsz = bs as usize;
    let mut sim = Sim {
        bs: bsz,
        l1: vec![None; num_blocks as usize * bsz],
        l2: vec![None; host as usize * bsz],
        store: HashMap::new(),
        tokens: HashMap::new(),
        ns: HashMap::new(),
    };
    let mut live: Vec<u64> = Vec::new();
    let mut next_id = 0u64;
    let step = |s: &mut Scheduler, sim: &mut Sim, live: &mut Vec<u64>, short: usize| {
        let p = s.schedule().unwrap();
        sim.apply(&p);
        sim.fetch(s, &p, short);
        check_tree(s, sim, live);
        let sampled: Vec<u32> = (0..p.num_sampled())
            .map(|k| {
                let id = p.sample_req_ids[k] as u64;
                sample(id, sim.tokens[&id].len())
            })
            .collect();
        for (k, &tok) in sampled.iter().enumerate() {
            sim.tokens
                .get_mut(&(p.sample_req_ids[k] as u64))
                .unwrap()
                .push(tok);
        }
        for f in s.update(p.step_id, &sampled).unwrap() {
            assert_ne!(f.reason, FinishReason::Abort);
            live.retain(|&x| x != f.req_id);
        }
        s.check_invariants().unwrap();
    };
    for op in ops {
        match op {
            Op::Add {
                prefix,
                len,
                max_tokens,
                ns,
            } => {
                // Prefix 3: no shared prefix.
                let shared = if prefix == 3 {
                    0
                } else {
                    (prefix as u32 + 1) * 10
                };
                let mut prompt: Vec<u32> = (0..shared).map(|i| 500 + i).collect();
                prompt.extend((0..len as u32).map(|i| 9000 + next_id as u32 * 64 + i));
                prompt.truncate(40);
                let mut r = NewRequest::new(next_id, prompt.clone(), max_tokens);
                r.namespace = ns;
                r.ignore_eos = true;
                if s.add_requests(vec![r]).is_ok() {
                    sim.tokens.insert(next_id, prompt);
                    sim.ns.insert(next_id, ns);
                    live.push(next_id);
                }
                next_id += 1;
            }
            Op::Abort(k) => {
                if !live.is_empty() {
                    let id = live.remove(k % live.len());
                    s.abort_requests(&[id]).unwrap();
                }
            }
            Op::Step(short) => step(&mut s, &mut sim, &mut live, short),
        }
        s.check_invariants().unwrap();
    }
    let mut n = 0;
    while s.has_unfinished() {
        step(&mut s, &mut sim, &mut live, n);
        n += 1;
        assert!(n < 5000, "not drained");
    }
    assert!(live.is_empty());
    assert_eq!(s.kv().num_free_blocks(), num_blocks - 1);
    let t = s.kv().tiers().unwrap();
    assert!(t.swaps.is_empty());
    t.check_invariants().unwrap();
    t.stats()
}

/// A fixed busy trace: every path (offload, L2 hit, swap out/in, fetch) is taken.
#[test]
fn scripted_trace_takes_every_tier_path() {
    let ops: Vec<Op> = (0..40)
        .flat_map(|i| {
            let add = Op::Add {
                prefix: i % 3,
                len: 10 + i % 20,
                max_tokens: 6,
                ns: 0,
            };
            [add, Op::Step(i), Op::Step(i + 1)]
        })
        .collect();
    let swap = run(16, 4, 24, 1, 24, ops.clone(), PrefixMode::Radix);
    assert!(
        swap.offloaded_blocks > 0 && swap.l2_hit_tokens > 0,
        "{swap:?}"
    );
    assert!(swap.swap_outs > 0 && swap.swap_ins > 0, "{swap:?}");
    // A prefix computed, flushed out of L1 and L2 by unrelated requests, then asked again.
    let mut ops = vec![Op::Add {
        prefix: 2,
        len: 4,
        max_tokens: 2,
        ns: 0,
    }];
    ops.extend((0..6).map(Op::Step));
    for i in 0..12 {
        ops.push(Op::Add {
            prefix: 3,
            len: 30,
            max_tokens: 2,
            ns: 0,
        });
        ops.extend((i..i + 4).map(Op::Step));
    }
    ops.push(Op::Add {
        prefix: 2,
        len: 4,
        max_tokens: 2,
        ns: 0,
    });
    let fetch = run(16, 4, 4, 3, 24, ops.clone(), PrefixMode::Radix);
    assert!(
        fetch.fetch_requests > 0 && fetch.fetched_blocks > 0,
        "{fetch:?}"
    );
    assert!(fetch.published_blocks > 0, "{fetch:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn tier_moves_keep_every_read_block_correct(
        num_blocks in 12u32..40,
        bs in prop_oneof![Just(2u32), Just(4), Just(8)],
        host in 0u32..24,
        mode in 0usize..6,
        budget in 4u32..48,
        ops in prop::collection::vec(op(), 1..60),
        prefix in 0usize..3,
    ) {
        let prefix = [PrefixMode::Radix, PrefixMode::Hash, PrefixMode::HashSha256][prefix];
        run(num_blocks, bs, host, mode, budget, ops, prefix);
    }
}
