"""Scheduler simulator: a synthetic arrival stream, no model, paged KV vs two baselines.

    python -m kvcore.tools.sim --seed 0
    python -m kvcore.tools.sim --replicas 64 --router prefix   # replicas, routers: sim_cluster

Requests arrive as a Poisson stream (``--rate`` per step) with uniform prompt lengths and
geometric output lengths under a ``--max-tokens`` cap. Every step "samples" one token per
sample row; a request emits EOS when it reaches its drawn output length. Three systems serve the
same stream with the same KV pool (``--num-blocks`` x ``--block-size`` tokens) and the same
step model (a token budget per step, decodes first, then prefill chunks in arrival order):

- **paged**: the Rust ``Scheduler`` (blocks on demand, preemption when the pool runs out);
- **static batching**: a batch forms when the previous one is done, padded to its longest
  prompt, each request reserving prompt + ``max_tokens``, and runs until its longest output ends;
- **max-length reservation**: continuous batching, but each request reserves prompt +
  ``max_tokens`` contiguous slots at admission (what paging removes).

Memory waste is the time-averaged fraction of allocated KV slots that hold no token.
"""

from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvcore._kvcore import Scheduler

EOS, TOKEN = 2, 1


@dataclass
class Workload:
    """The arrival stream: arrival step, prompt length and output length per request."""

    arrival: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray
    max_tokens: int


@dataclass
class Result:
    """What one system did with the stream."""

    name: str
    peak_running: int = 0
    running: list[int] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)  # allocated / pool
    waste: list[float] = field(default_factory=list)  # (allocated - held) / allocated
    latency: list[int] = field(default_factory=list)
    preemptions: int = 0
    steps: int = 0

    def record(self, running: int, allocated: float, held: float, pool: float) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, running)
        self.running.append(running)
        self.usage.append(allocated / pool)
        if allocated > 0:
            self.waste.append((allocated - held) / allocated)


def make_workload(seed: int, num_requests: int, rate: float, max_tokens: int) -> Workload:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num_requests)
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    prompt_len = rng.integers(32, 513, size=num_requests)
    output_len = np.minimum(rng.geometric(1.0 / 160, size=num_requests), max_tokens)
    return Workload(arrival, prompt_len, output_len, max_tokens)


def run_paged(wl: Workload, args: argparse.Namespace) -> Result:
    s = Scheduler(
        args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.max_num_seqs,
        max_model_len=1 << 20,
        prefix_mode=args.prefix_mode,
        eos_token_id=EOS,
    )
    rng = np.random.default_rng(args.seed + 1)
    res, n = Result("paged (kvcore)"), len(wl.arrival)
    generated = np.zeros(n, np.int64)
    finished_at = np.full(n, -1, np.int64)
    pool = (args.num_blocks - 1) * args.block_size
    nxt, t = 0, 0
    while nxt < n or s.has_unfinished():
        hi = int(np.searchsorted(wl.arrival, t, side="right"))
        if hi > nxt:
            lens = wl.prompt_len[nxt:hi]
            offsets = np.concatenate([[0], np.cumsum(lens)])
            tokens = rng.integers(3, 32000, size=int(offsets[-1]))
            s.add_requests(np.arange(nxt, hi), tokens, offsets, wl.max_tokens)
            nxt = hi
        plan = s.schedule()
        ids = plan.sample_req_ids
        generated[ids] += 1
        sampled = np.where(generated[ids] >= wl.output_len[ids], EOS, TOKEN)
        out = s.update(plan.step_id, sampled)
        finished_at[out.req_ids] = t
        st = s.stats()
        allocated = st.kv_usage * pool
        res.record(st.num_running, allocated, st.num_computed_tokens, pool)
        t += 1
    s.check_invariants()
    res.preemptions = s.stats().num_preemptions
    res.latency = (finished_at - wl.arrival + 1).tolist()
    assert (generated == wl.output_len).all(), "every request emits exactly its output length"
    return res


@dataclass
class _Req:
    i: int
    prompt: int
    output: int
    reserve: int
    computed: int = 0
    generated: int = 0
    pad: int = 0  # static batching: padding tokens in front of the prompt


def _advance(running: list[_Req], budget: int) -> None:
    """One step of the shared step model: decodes first, then prefill chunks in order."""
    for r in running:
        if r.computed >= r.prompt and r.generated < r.output:
            r.computed += 1
            r.generated += 1
            budget -= 1
    for r in running:
        if r.computed < r.prompt and budget > 0:
            chunk = min(r.prompt - r.computed, budget)
            r.computed += chunk
            budget -= chunk
            if r.computed == r.prompt:
                r.generated = 1  # the step that completes a prompt samples its first token


def run_reserved(wl: Workload, args: argparse.Namespace, static: bool) -> Result:
    """The baselines: every request reserves prompt + max_tokens slots from admission."""
    name = "static batching" if static else "max-length reservation"
    res, n = Result(name), len(wl.arrival)
    pool = (args.num_blocks - 1) * args.block_size
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    reserved, nxt, t, done = 0, 0, 0, 0
    while done < n:
        while nxt < n and wl.arrival[nxt] <= t:
            p = int(wl.prompt_len[nxt])
            waiting.append(_Req(nxt, p, int(wl.output_len[nxt]), p + wl.max_tokens))
            nxt += 1
        if static and not running and waiting:
            # A new batch: padded to its longest prompt, as many as the pool can reserve.
            longest = 0
            while waiting and len(running) < args.max_num_seqs:
                cand = max(longest, waiting[0].prompt)
                if (len(running) + 1) * (cand + wl.max_tokens) > pool:
                    break
                longest = cand
                running.append(waiting.popleft())
            for r in running:
                r.pad, r.prompt = longest - r.prompt, longest  # computed, held, but wasted
            reserved = len(running) * (longest + wl.max_tokens)
        elif not static:
            while waiting and len(running) < args.max_num_seqs:
                if reserved + waiting[0].reserve > pool:
                    break
                r = waiting.popleft()
                reserved += r.reserve
                running.append(r)
        _advance(running, args.budget)
        held = sum(max(0, r.computed - r.pad) for r in running)
        res.record(sum(r.generated < r.output for r in running), reserved, held, pool)
        for r in running:
            if r.generated == r.output and r.i >= 0:
                res.latency.append(t - int(wl.arrival[r.i]) + 1)
                r.i, done = -1, done + 1
        if static:
            if all(r.i < 0 for r in running):
                running, reserved = [], 0
        else:
            reserved -= sum(r.reserve for r in running if r.i < 0)
            running = [r for r in running if r.i >= 0]
        t += 1
    return res


def compare(args: argparse.Namespace) -> list[Result]:
    wl = make_workload(args.seed, args.requests, args.rate, args.max_tokens)
    too_big = wl.prompt_len + wl.max_tokens > (args.num_blocks - 1) * args.block_size
    if too_big.any():
        raise SystemExit("a request cannot fit in the pool: raise --num-blocks")
    return [
        run_paged(wl, args),
        run_reserved(wl, args, static=True),
        run_reserved(wl, args, static=False),
    ]


def table(results: list[Result]) -> str:
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    rows = [
        ("peak concurrency (requests)", lambda r: f"{r.peak_running}"),
        ("mean concurrency (requests)", lambda r: f"{mean(r.running):.1f}"),
        ("mean KV usage (allocated/pool)", lambda r: f"{100 * mean(r.usage):.1f}%"),
        ("memory waste (allocated, unused)", lambda r: f"{100 * mean(r.waste):.1f}%"),
        ("preemptions", lambda r: f"{r.preemptions}"),
        ("steps to drain", lambda r: f"{r.steps}"),
        ("mean latency (steps)", lambda r: f"{mean(r.latency):.0f}"),
    ]
    width = [34] + [max(24, len(r.name) + 2) for r in results]
    lines = [
        "".join(
            h.ljust(w) for h, w in zip(["metric"] + [r.name for r in results], width, strict=True)
        )
    ]
    lines.append("-" * sum(width))
    for label, fmt in rows:
        cells = [label] + [fmt(r) for r in results]
        lines.append("".join(c.ljust(w) for c, w in zip(cells, width, strict=True)))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Paged KV scheduling vs static batching and "
        "max-length reservation on one synthetic stream."
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per step")
    ap.add_argument("--num-blocks", type=int, default=2049, help="null block included")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per step")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024, help="output cap per request")
    ap.add_argument("--prefix-mode", default="off", choices=("off", "radix", "hash"))
    return ap


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--replicas" or a.startswith("--replicas=") for a in argv):
        from kvcore.tools import sim_cluster  # many replicas behind a router: its own simulator

        sim_cluster.main(argv)
        return
    args = parser().parse_args(argv)
    results = compare(args)
    print(
        f"# {args.requests} requests, {args.rate}/step, prompts 32-512, outputs geometric "
        f"(mean 160, cap {args.max_tokens}); pool {(args.num_blocks - 1) * args.block_size} "
        f"tokens; budget {args.budget} tokens/step; seed {args.seed}"
    )
    print(table(results))


if __name__ == "__main__":
    main()
