"""Differential tests: seeded random traces through kvcore and the pure-Python reference."""

import random

import pytest
from manager_driver import Driver

BASES = [[(i * k) % 5 for i in range(40)] for k in (1, 2, 3)]


def prompt(rng: random.Random) -> list[int]:
    base = rng.choice(BASES)[: rng.randrange(0, 41)]
    return base + [rng.randrange(4) for _ in range(rng.randrange(0 if base else 1, 8))]


def run_trace(seed: int, mode: str, steps: int) -> Driver:
    rng = random.Random(seed)
    d = Driver(rng.randrange(6, 60), rng.choice([1, 2, 3, 4, 8]), mode)
    for _ in range(steps):
        live = sorted(d.tokens)
        op = rng.random()
        if op < 0.3 or not live:
            n = rng.randrange(1, 4)
            prompts = [prompt(rng) for _ in range(n)]
            extra = [rng.randrange(0, 5) for _ in range(n)]
            ns = [rng.choice([0, 0, 1]) for _ in range(n)]
            too_long = [len(p) + e > d.ref.max_tokens for p, e in zip(prompts, extra, strict=True)]
            if not any(too_long):
                d.admit(prompts, extra, ns, wm=rng.choice([0, 0, 2]))
        elif op < 0.55:
            reqs = rng.sample(live, rng.randrange(1, len(live) + 1))
            grow = [rng.randrange(1, 9) for _ in reqs]
            if all(d.covered(r) + g <= d.ref.max_tokens for r, g in zip(reqs, grow, strict=True)):
                d.allocate(reqs, grow)
        elif op < 0.65:
            d.cache(rng.sample(live, rng.randrange(1, len(live) + 1)))
        elif op < 0.75:
            d.fork(rng.sample(live, 1))
        elif op < 0.9:
            d.free(rng.sample(live, rng.randrange(1, min(3, len(live)) + 1)), rng.random() < 0.8)
        else:
            d.drain()
        d.compare()
    return d


@pytest.mark.parametrize("mode", ["off", "radix", "hash"])
@pytest.mark.parametrize("seed", range(40))
def test_random_trace_matches_reference(seed, mode):
    d = run_trace(seed, mode, 120)
    d.drain()
    d.free(sorted(d.tokens), with_tokens=False)
    d.compare()
    assert d.rust.num_free_blocks == d.rust.num_blocks - 1


def test_traces_exercise_hits_copies_evictions_and_dedup():
    total = {"hit_tokens": 0, "copy_ops": 0, "evictions": 0, "deduplicated_blocks": 0}
    for seed in range(40):
        stats = run_trace(seed, "radix", 120).rust.stats()
        for k in total:
            total[k] += stats[k]
    assert all(v > 0 for v in total.values()), total
