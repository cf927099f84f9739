"""Seeded trace generators for the allocator and prefix-cache benchmarks (issue 2).

churn: alloc/free of sequences of 1..4096 tokens, block size 16, a 65,536-block pool held
about 80% full, in rounds of continuous batching (free a batch, admit until 80% full again).

prefix trace: 2,000 requests over 50 system prompts of 500..2,000 tokens with Zipf popularity,
each with a unique 50..500-token suffix and a 16..256-token output; 40% continue an earlier
conversation (its prompt + output + a new suffix). The replay keeps 32 requests in flight and
completes them oldest first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

VOCAB = 32_000


@dataclass
class ChurnRound:
    free: list[int]  # ids freed this round
    alloc: list[tuple[int, int]]  # (id, num_tokens) admitted this round


def churn(
    seed: int,
    num_ops: int = 100_000,
    num_blocks: int = 65_536,
    block_size: int = 16,
    max_tokens: int = 4096,
    fill: float = 0.8,
    batch: int = 32,
) -> Iterator[ChurnRound]:
    """Rounds of frees then allocs; ops (allocs + frees) total `num_ops`, then all is freed."""
    rng = np.random.default_rng(seed)
    target = int(fill * (num_blocks - 1))
    live: dict[int, int] = {}  # id -> blocks
    used, next_id, ops = 0, 1, 0
    while ops < num_ops:
        free: list[int] = []
        if used >= target and live:
            ids = list(live)
            k = min(batch, len(ids), num_ops - ops)
            for j in rng.choice(len(ids), size=k, replace=False):
                rid = ids[int(j)]
                free.append(rid)
                used -= live.pop(rid)
            ops += len(free)
        alloc: list[tuple[int, int]] = []
        while used < target and ops < num_ops:
            n = int(rng.integers(1, max_tokens + 1))
            blocks = -(-n // block_size)
            if used + blocks > num_blocks - 1:
                break
            alloc.append((next_id, n))
            live[next_id] = blocks
            used += blocks
            next_id += 1
            ops += 1
        yield ChurnRound(free, alloc)
    yield ChurnRound(list(live), [])


@dataclass
class PrefixRequest:
    prompt: np.ndarray  # uint32 tokens
    output: np.ndarray  # uint32 tokens generated (inserted on completion)


def prefix_trace(
    seed: int,
    num_requests: int = 2000,
    num_system: int = 50,
    continue_frac: float = 0.4,
    zipf_s: float = 1.1,
) -> list[PrefixRequest]:
    """The prefix-sharing trace of issue 2 (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(0, VOCAB, int(rng.integers(500, 2001)), dtype=np.uint32)
        for _ in range(num_system)
    ]
    ranks = np.arange(1, num_system + 1, dtype=np.float64)
    popularity = ranks**-zipf_s / np.sum(ranks**-zipf_s)
    reqs: list[PrefixRequest] = []
    for i in range(num_requests):
        suffix = rng.integers(0, VOCAB, int(rng.integers(50, 501)), dtype=np.uint32)
        output = rng.integers(0, VOCAB, int(rng.integers(16, 257)), dtype=np.uint32)
        if i > 0 and rng.random() < continue_frac:
            prev = reqs[int(rng.integers(0, i))]
            prompt = np.concatenate([prev.prompt, prev.output, suffix])
        else:
            system = systems[int(rng.choice(num_system, p=popularity))]
            prompt = np.concatenate([system, suffix])
        reqs.append(PrefixRequest(prompt, output))
    return reqs


def replay_order(
    num_requests: int, in_flight: int = 32, batch: int = 8
) -> list[tuple[str, list[int]]]:
    """('admit', idx) / ('finish', idx) steps: fill to `in_flight`, then finish the oldest
    `batch` and admit `batch` more, until every request has finished."""
    steps: list[tuple[str, list[int]]] = []
    running: list[int] = []
    nxt = 0
    while nxt < num_requests or running:
        if nxt < num_requests and len(running) < in_flight:
            k = min(batch, in_flight - len(running), num_requests - nxt)
            ids = list(range(nxt, nxt + k))
            steps.append(("admit", ids))
            running += ids
            nxt += k
        else:
            done, running = running[:batch], running[batch:]
            steps.append(("finish", done))
    return steps


def ideal_hit_rate(
    reqs: list[PrefixRequest], steps: list[tuple[str, list[int]]], block_size: int
) -> float:
    """Hit rate of an infinite cache at `block_size` granularity on the same replay: the
    longest prefix (whole blocks, at most len - 1 tokens) of each prompt that some finished
    request's prompt + output starts with."""
    seen: set[int] = set()
    hit = total = 0
    for kind, ids in steps:
        for i in ids:
            r = reqs[i]
            if kind == "admit":
                toks = r.prompt
                total += len(toks)
                n_blocks = (len(toks) - 1) // block_size
                h, k = 0, 0
                while k < n_blocks:
                    h = hash((h, toks[k * block_size : (k + 1) * block_size].tobytes()))
                    if h not in seen:
                        break
                    k += 1
                hit += k * block_size
            else:
                seq = np.concatenate([r.prompt, r.output])
                h = 0
                for k in range(len(seq) // block_size):
                    h = hash((h, seq[k * block_size : (k + 1) * block_size].tobytes()))
                    seen.add(h)
    return hit / total
