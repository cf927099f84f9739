//! Criterion benches of the Rust core on the issue-2 workloads (no Python in the loop):
//! churn (alloc/free, prefix cache off/radix/hash) and the prefix-sharing trace replay.
//! Throughput is per block (churn) or per request (trace). Run: `cargo bench --bench kv_manager`.

use std::hint::black_box;
use std::time::Duration;

use _kvcore::{KvManager, KvManagerConfig, PrefixMode};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

mod workloads;
use workloads::{churn, prefix_trace, Request, Rng, Round};

const BS: u32 = 16;

fn manager(num_blocks: u32, mode: PrefixMode) -> KvManager {
    KvManager::new(KvManagerConfig {
        num_blocks,
        block_size: BS,
        prefix_mode: mode,
    })
    .unwrap()
}

/// Replays churn rounds; with a prefix cache each request's tokens are a slice of `pool`.
fn replay_churn(m: &mut KvManager, rounds: &[Round], pool: &[u32], starts: &[usize]) {
    let mut ops = Vec::new();
    for r in rounds {
        for &id in &r.free {
            let (s, n) = (starts[id as usize], m.num_tokens(id).unwrap());
            m.free(id, &pool[s..s + n]).unwrap();
        }
        for &(id, n) in &r.alloc {
            let s = starts[id as usize];
            let toks = &pool[s..s + n];
            let hit = m.match_prefix(0, toks, n - 1);
            let new = n - hit.num_tokens;
            assert!(m.admit(id, 0, toks, &hit, new, 0).unwrap());
        }
        m.drain_copy_ops(&mut ops);
        ops.clear();
    }
}

/// Replays the trace with 32 requests in flight, admitting and finishing in batches of 8.
fn replay_trace(m: &mut KvManager, reqs: &[Request]) {
    let mut running: std::collections::VecDeque<usize> = Default::default();
    let mut ops = Vec::new();
    let mut full = Vec::new();
    let mut next = 0;
    while next < reqs.len() || !running.is_empty() {
        if next < reqs.len() && running.len() < 32 {
            let end = (next + 8).min(reqs.len());
            for (i, r) in reqs.iter().enumerate().take(end).skip(next) {
                let hit = m.match_prefix(0, &r.prompt, r.prompt.len() - 1);
                let new = r.prompt.len() + r.output.len() - hit.num_tokens;
                assert!(m.admit(i as u64, 0, &r.prompt, &hit, new, 0).unwrap());
                running.push_back(i);
            }
            next = end;
            m.drain_copy_ops(&mut ops);
            ops.clear();
        } else {
            for _ in 0..8.min(running.len()) {
                let i = running.pop_front().unwrap();
                full.clear();
                full.extend_from_slice(&reqs[i].prompt);
                full.extend_from_slice(&reqs[i].output);
                m.free(i as u64, &full).unwrap();
            }
        }
    }
}

fn bench_churn(c: &mut Criterion) {
    let num_blocks = 65_536;
    let rounds = churn(0, 100_000, num_blocks, BS as usize);
    let max_id = rounds
        .iter()
        .flat_map(|r| r.alloc.iter().map(|a| a.0))
        .max()
        .unwrap() as usize;
    let mut rng = Rng::new(1);
    let pool = rng.tokens(1 << 22);
    let starts: Vec<usize> = (0..=max_id)
        .map(|_| rng.range(0, (1 << 22) - 4097) as usize)
        .collect();
    let blocks: u64 = rounds
        .iter()
        .flat_map(|r| r.alloc.iter())
        .map(|a| a.1.div_ceil(BS as usize) as u64)
        .sum();
    let mut g = c.benchmark_group("churn");
    g.throughput(Throughput::Elements(blocks));
    for mode in [PrefixMode::Off, PrefixMode::Radix, PrefixMode::Hash] {
        g.bench_function(mode.name(), |b| {
            b.iter_batched_ref(
                || manager(num_blocks, mode),
                |m| replay_churn(black_box(m), &rounds, &pool, &starts),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

fn bench_trace(c: &mut Criterion) {
    let reqs = prefix_trace(0, 2000);
    let mut g = c.benchmark_group("prefix_trace");
    g.throughput(Throughput::Elements(reqs.len() as u64));
    for (mode, pool) in [
        (PrefixMode::Radix, 65_536),
        (PrefixMode::Hash, 65_536),
        (PrefixMode::Radix, 16_384),
        (PrefixMode::Hash, 16_384),
    ] {
        g.bench_function(format!("{}_{pool}", mode.name()), |b| {
            b.iter_batched_ref(
                || manager(pool, mode),
                |m| replay_trace(black_box(m), &reqs),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = bench_churn, bench_trace
}
criterion_main!(benches);
