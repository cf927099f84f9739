//! Property tests: random operation sequences against a simulated KV memory.
//!
//! Each block slot of a shadow memory holds the token whose KV it stores. The simulation
//! applies drained copy ops, then writes each step's tokens through the block table. After
//! every operation: `check_invariants()`, every live request reads back exactly its computed
//! tokens (so copy-on-write never let a write hit a shared block), and every prefix hit's
//! blocks hold exactly the matched tokens. Errors must leave the state unchanged. A deferred
//! admission leaves its copy ops pending (freeing it must cancel them: `check_invariants`
//! refuses an op that writes a free block); a request stating other tokens is refused.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const EMPTY: u32 = u32::MAX;

/// 96 cases by default; `PROPTEST_CASES=n` runs more.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96)
}

#[derive(Debug, Clone)]
enum Op {
    Admit {
        base: u8,
        cut: u8,
        suffix: Vec<u8>,
        ns: bool,
        chunk: u8,
        defer: bool,
    },
    Step {
        pick: u8,
        n: u8,
        tok: u8,
    },
    Fork {
        pick: u8,
    },
    Free {
        pick: u8,
        cache: bool,
    },
    Bad {
        pick: u8,
        kind: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<u8>(), any::<u8>(), prop::collection::vec(0u8..4, 0..12), any::<bool>(), 1u8..40, any::<bool>())
            .prop_map(|(base, cut, suffix, ns, chunk, defer)| Op::Admit { base, cut, suffix, ns, chunk, defer }),
        4 => (any::<u8>(), 1u8..12, 0u8..3).prop_map(|(pick, n, tok)| Op::Step { pick, n, tok }),
        1 => any::<u8>().prop_map(|pick| Op::Fork { pick }),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(pick, cache)| Op::Free { pick, cache }),
        1 => (any::<u8>(), 0u8..8).prop_map(|(pick, kind)| Op::Bad { pick, kind }),
    ]
}

struct Req {
    ns: u64,
    tokens: Vec<u32>,
    computed: usize,
}

struct Sim {
    m: KvManager,
    bs: usize,
    kv: Vec<u32>,
    reqs: BTreeMap<u64, Req>,
    next_id: u64,
}

/// Three base prompts with long common stretches, so hits and splits are frequent.
fn base_prompt(i: u8) -> Vec<u32> {
    (0..48u32)
        .map(|p| {
            if p < 20 || i % 3 == 0 {
                p % 5
            } else {
                (p * (i as u32 % 3 + 1)) % 7
            }
        })
        .collect()
}

impl Sim {
    fn pick(&self, pick: u8) -> Option<u64> {
        let n = self.reqs.len();
        (n > 0).then(|| *self.reqs.keys().nth(pick as usize % n).unwrap())
    }

    fn slot(&self, table: &[u32], p: usize) -> usize {
        table[p / self.bs] as usize * self.bs + p % self.bs
    }

    fn apply_copies_and_write(&mut self, req: u64, from: usize, to: usize) {
        let mut ops = Vec::new();
        self.m.drain_copy_ops(&mut ops);
        for [src, dst] in ops {
            let (s, d) = (src as usize * self.bs, dst as usize * self.bs);
            for i in 0..self.bs {
                self.kv[d + i] = self.kv[s + i];
            }
        }
        let table = self.m.block_table(req).unwrap().to_vec();
        for p in from..to {
            let s = self.slot(&table, p);
            self.kv[s] = self.reqs[&req].tokens[p];
        }
        self.reqs.get_mut(&req).unwrap().computed = to;
        let r = &self.reqs[&req];
        self.m.cache_computed(req, &r.tokens[..to]).unwrap();
    }

    fn check(&self) {
        self.m.check_invariants().unwrap();
        for (&id, r) in &self.reqs {
            let table = self.m.block_table(id).unwrap();
            for p in 0..r.computed {
                assert_eq!(
                    self.kv[self.slot(table, p)],
                    r.tokens[p],
                    "request {id} position {p}"
                );
            }
        }
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::Admit {
                base,
                cut,
                suffix,
                ns,
                chunk,
                defer,
            } => {
                let mut tokens = base_prompt(base);
                tokens.truncate(cut as usize % 49);
                tokens.extend(suffix.iter().map(|&t| t as u32));
                if tokens.is_empty() {
                    tokens.push(1);
                }
                let ns = ns as u64;
                let hit = self.m.match_prefix(ns, &tokens, tokens.len() - 1);
                for (p, &t) in tokens[..hit.num_tokens].iter().enumerate() {
                    let s = hit.blocks()[p / self.bs] as usize * self.bs + p % self.bs;
                    assert_eq!(self.kv[s], t, "hit block content at {p}");
                }
                let room = self.m.max_tokens().saturating_sub(hit.num_tokens);
                let new = (chunk as usize)
                    .min(tokens.len() - hit.num_tokens)
                    .min(room);
                if new == 0 {
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                if self.m.admit(id, ns, &tokens, &hit, new, 1).unwrap() {
                    let end = hit.num_tokens + new;
                    // Deferred: nothing drained or written; only the hit's full blocks count.
                    let computed = if defer {
                        hit.num_tokens / self.bs * self.bs
                    } else {
                        hit.num_tokens
                    };
                    self.reqs.insert(
                        id,
                        Req {
                            ns,
                            tokens,
                            computed,
                        },
                    );
                    if !defer {
                        self.apply_copies_and_write(id, hit.num_tokens, end);
                    }
                }
            }
            Op::Step { pick, n, tok } => {
                let Some(id) = self.pick(pick) else { return };
                let r = self.reqs.get_mut(&id).unwrap();
                let total = r.computed + n as usize;
                while r.tokens.len() < total {
                    r.tokens.push(tok as u32 + (id as u32 % 2));
                }
                let from = r.computed;
                if total <= self.m.max_tokens() && self.m.allocate_slots(id, total).unwrap() {
                    self.apply_copies_and_write(id, from, total);
                }
            }
            Op::Fork { pick } => {
                let Some(id) = self.pick(pick) else { return };
                if self.m.num_tokens(id).unwrap() != self.reqs[&id].computed {
                    return; // a deferred table: the sim writes only behind computed tokens
                }
                let child = self.next_id;
                self.next_id += 1;
                self.m.fork(id, child).unwrap();
                let r = &self.reqs[&id];
                let tokens = r.tokens[..r.computed].to_vec();
                let (ns, computed) = (r.ns, r.computed);
                self.reqs.insert(
                    child,
                    Req {
                        ns,
                        tokens,
                        computed,
                    },
                );
            }
            Op::Free { pick, cache } => {
                let Some(id) = self.pick(pick) else { return };
                let r = self.reqs.remove(&id).unwrap();
                let toks = if cache {
                    &r.tokens[..r.computed]
                } else {
                    &[][..]
                };
                self.m.free(id, toks).unwrap();
            }
            Op::Bad { pick, kind } => {
                let before = format!("{:?}", self.m);
                let id = self.pick(pick).unwrap_or(0);
                let live = self.reqs.contains_key(&id);
                let too_many = vec![0u32; self.m.num_tokens(id).unwrap_or(0) + 1];
                let res = match kind {
                    0 => self.m.free(1 << 40, &[]),
                    1 if live => self
                        .m
                        .admit(id, 0, &[1], &PrefixHit::default(), 1, 0)
                        .map(|_| ()),
                    2 => self.m.allocate_slots(id.max(1 << 40), 1).map(|_| ()),
                    3 if live => self.m.cache_computed(id, &too_many),
                    4 if live => self.m.fork(id, id),
                    6 | 7
                        if live
                            && self.reqs[&id].computed > 0
                            && self.m.prefix_mode() != PrefixMode::Off =>
                    {
                        // Token 0 is always known (the prompt): another one is refused.
                        let mut lie = self.reqs[&id].tokens[..self.reqs[&id].computed].to_vec();
                        lie[0] ^= 1 << 20;
                        if kind == 6 {
                            self.m.cache_computed(id, &lie)
                        } else {
                            self.m.free(id, &lie)
                        }
                    }
                    _ => self
                        .m
                        .allocate_slots(id, self.m.max_tokens() + 1)
                        .map(|_| ()),
                };
                assert!(res.is_err(), "{kind}: {res:?}");
                assert_eq!(format!("{:?}", self.m), before);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn random_ops_keep_invariants_and_kv_contents(
        num_blocks in 4u32..48,
        bs in 1u32..6,
        mode in 0u8..3,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let prefix_mode = [PrefixMode::Off, PrefixMode::Radix, PrefixMode::Hash][mode as usize];
        let m = KvManager::new(KvManagerConfig { num_blocks, block_size: bs, prefix_mode }).unwrap();
        let kv = vec![EMPTY; (num_blocks * bs) as usize];
        let mut sim = Sim { m, bs: bs as usize, kv, reqs: BTreeMap::new(), next_id: 1 };
        for op in ops {
            sim.run(op);
            sim.check();
        }
        for id in sim.reqs.keys().copied().collect::<Vec<_>>() {
            sim.m.free(id, &[]).unwrap();
        }
        let mut ops = Vec::new();
        sim.m.drain_copy_ops(&mut ops);
        sim.m.check_invariants().unwrap();
        prop_assert_eq!(sim.m.num_free_blocks(), num_blocks - 1);
    }
}
