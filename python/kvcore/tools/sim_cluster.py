"""Cluster simulator: many engine replicas behind a router, on a shared-prefix chat stream.

    python -m kvcore.tools.sim --replicas 64 --router prefix|p2c|random|ray-prefix --seed 0

The routers are the real ones (``kvcore.scaleout.router``; ``ray-prefix`` is Ray's
PrefixCacheAffinityRouter's rule over Ray's own tree, ``kvcore.scaleout.ray_model``); each replica
is a cost model of the engine with a real prefix cache (kvcore's Rust ``KvCacheManager``, radix
mode, LRU eviction):

- continuous batching, FCFS: a step admits waiting requests while they fit (``--max-num-seqs``,
  ``--max-batched-tokens`` uncached prompt tokens, and KV blocks for prompt + output), prefills
  the uncached part of their prompts whole, and decodes one token for every running request;
- a step lasts ``--step-ms + --prefill-ms * uncached prompt tokens + --decode-ms * running``;
  a request's first token comes at the end of its prefill step (TTFT includes queueing);
- a finished request frees its blocks, its prompt's full blocks staying cached (LRU).

The workload: ``--systems`` system prompts of ``--system-len`` tokens, picked with Zipf
popularity ``--zipf`` (0 = uniform), each followed by a fresh user turn (uniform length) and an
output of uniform length; Poisson arrivals at ``--rate`` requests/s per replica. ``hit_rate`` is
prompt tokens served from cache over prompt tokens; ``hit_rate_single`` is the same stream fed to
one cache as large as all replicas' together (the ceiling routing can approach); ``imbalance``
is the busiest replica's request count over the mean.
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvcore._kvcore import KvCacheManager
from kvcore.scaleout.policies import make_router


@dataclass
class Req:
    """One request of the stream."""

    id: int
    arrival: float  # seconds
    prompt: np.ndarray  # uint32 token ids
    output_len: int
    replica: int = -1
    hit: int = 0
    first_token: float = -1.0
    left: int = 0  # tokens still to decode


def make_stream(args: argparse.Namespace) -> list[Req]:
    """The shared-prefix chat stream (seeded)."""
    rng = np.random.default_rng(args.seed)
    n = args.requests_per_replica * args.replicas
    systems = [
        rng.integers(1000, 30000, size=args.system_len, dtype=np.uint32)
        for _ in range(args.systems)
    ]
    weights = 1.0 / np.arange(1, args.systems + 1) ** args.zipf
    which = rng.choice(args.systems, size=n, p=weights / weights.sum())
    gaps = rng.exponential(1.0 / (args.rate * args.replicas), size=n)
    arrivals = np.cumsum(gaps)
    reqs = []
    for i in range(n):
        user = rng.integers(30000, 60000, size=int(rng.integers(*args.user_len)), dtype=np.uint32)
        prompt = np.concatenate([systems[which[i]], user])
        reqs.append(Req(i, float(arrivals[i]), prompt, int(rng.integers(*args.output_len))))
    return reqs


class Replica:
    """Cost model of one engine: a KV pool with a prefix cache, continuous batching."""

    def __init__(self, index: int, args: argparse.Namespace):
        self.index = index
        self.args = args
        self.cache = KvCacheManager(args.kv_blocks + 1, args.block_size, "radix")
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy = False
        self.num_routed = 0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self, now: float) -> tuple[float, list[Req], list[Req]]:
        """Run one step from ``now``: (its end, requests prefilled, requests finished)."""
        a = self.args
        decoding = list(self.running)
        admitted: list[Req] = []
        prefill = 0
        while self.waiting and len(self.running) < a.max_num_seqs:
            r = self.waiting[0]
            uncached = len(r.prompt) - int(self.cache.match_prefix(r.prompt)[0])
            if admitted and prefill + uncached > a.max_batched_tokens:
                break
            got = self.cache.admit(r.id, len(r.prompt) + r.output_len, r.prompt)
            if len(got) == 0:
                break  # out of KV blocks: wait for a finish
            self.cache.drain_copy_ops()
            r.hit = int(got[0])
            prefill += len(r.prompt) - r.hit
            self.waiting.popleft()
            self.running.append(r)
            admitted.append(r)
        ms = a.step_ms + a.prefill_ms * prefill + a.decode_ms * len(decoding)
        end = now + ms / 1000.0
        finished = []
        for r in admitted:
            r.first_token, r.left = end, r.output_len - 1
        for r in decoding:
            r.left -= 1
        for r in list(self.running):
            if r.left <= 0:
                self.running.remove(r)
                self.cache.free(r.id, r.prompt)  # the prompt's full blocks stay cached
                finished.append(r)
        return end, admitted, finished


def simulate(args: argparse.Namespace, router_name: str, reqs: list[Req]) -> dict[str, float]:
    """Serve the stream with the named router; the figures of the run."""
    kwargs: dict = {}
    if router_name == "prefix":
        kwargs = dict(
            threshold=args.threshold, rel_threshold=args.rel_threshold, tree_blocks=args.kv_blocks
        )
        kwargs["block_size"] = args.block_size
    elif router_name == "ray-prefix" and args.ray_imbalanced_threshold is not None:
        kwargs = {"imbalanced_threshold": args.ray_imbalanced_threshold}
    router = make_router(router_name, seed=args.seed, **kwargs)
    replicas = [Replica(i, args) for i in range(args.replicas)]
    events: list[tuple[float, int, int]] = [(r.arrival, 0, r.id) for r in reqs]  # 0 arrival
    heapq.heapify(events)
    while events:
        now, kind, key = heapq.heappop(events)
        if kind == 0:
            req = reqs[key]
            choice = router.choose(req.prompt, {rep.index: rep.load for rep in replicas})
            router.routed(choice, req.prompt)
            rep = replicas[choice]
            req.replica, rep.num_routed = choice, rep.num_routed + 1
            rep.waiting.append(req)
            if not rep.busy:
                rep.busy = True
                heapq.heappush(events, (now, 1, choice))
        else:
            rep = replicas[key]
            if not rep.running and not rep.waiting:
                rep.busy = False
                continue
            end, _, _ = rep.step(now)
            heapq.heappush(events, (end, 1, key))
    ttft = np.array([(r.first_token - r.arrival) * 1000.0 for r in reqs])
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    counts = np.array([rep.num_routed for rep in replicas])
    span = max(r.first_token for r in reqs) - reqs[0].arrival
    return {
        "hit_rate": sum(r.hit for r in reqs) / prompt_tokens,
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "imbalance": float(counts.max() / counts.mean()),
        "throughput_req_s": len(reqs) / span,
    }


def single_cache_hit_rate(args: argparse.Namespace, reqs: list[Req]) -> float:
    """Hit rate of the stream on one cache as large as every replica's together."""
    cache = KvCacheManager(args.kv_blocks * args.replicas + 1, args.block_size, "radix")
    hits = 0
    for r in reqs:
        hits += int(cache.admit(r.id, len(r.prompt), r.prompt)[0])
        cache.drain_copy_ops()
        cache.free(r.id, r.prompt)
    return hits / sum(len(r.prompt) for r in reqs)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvcore.tools.sim --replicas N",
        description="Engine replicas behind a router (prefix-aware, p2c, random): cost model.",
    )
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument(
        "--router",
        default="prefix",
        choices=("prefix", "p2c", "random", "ray-prefix"),
        help="ray-prefix: Ray's PrefixCacheAffinityRouter policy over Ray's own tree "
        "(serve/ray_model.py)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests-per-replica", type=int, default=200)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second per replica")
    ap.add_argument("--systems", type=int, default=32, help="distinct system prompts")
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, nargs=2, default=(64, 256), metavar=("LO", "HI"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("LO", "HI"))
    ap.add_argument("--zipf", type=float, default=0.5, help="system prompt popularity exponent")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV blocks per replica")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--step-ms", type=float, default=5.0, help="fixed cost per step")
    ap.add_argument("--prefill-ms", type=float, default=0.05, help="per uncached prompt token")
    ap.add_argument("--decode-ms", type=float, default=0.2, help="per running request per step")
    ap.add_argument("--threshold", type=int, default=2, help="prefix router: queue slack")
    ap.add_argument(
        "--rel-threshold", type=float, default=1.5, help="prefix router: queue ratio slack"
    )
    ap.add_argument(
        "--ray-imbalanced-threshold",
        type=float,
        default=None,
        help="ray-prefix: its imbalanced_threshold (default Ray's: inf)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.replicas < 1:
        parser().error("--replicas must be at least 1")
    t0 = time.perf_counter()
    reqs = make_stream(args)
    res = simulate(args, args.router, reqs)
    print(
        f"# {len(reqs)} requests, {args.replicas} replicas, router {args.router}, "
        f"{args.systems} system prompts of {args.system_len} tokens (zipf {args.zipf}), "
        f"{args.kv_blocks * args.block_size} KV tokens per replica, seed {args.seed}"
    )
    print(f"hit_rate: {res['hit_rate']:.4f} ratio")
    print(f"hit_rate_single: {single_cache_hit_rate(args, reqs):.4f} ratio")
    print(f"ttft_p50_ms: {res['ttft_p50_ms']:.1f} ms")
    print(f"ttft_p95_ms: {res['ttft_p95_ms']:.1f} ms")
    print(f"imbalance: {res['imbalance']:.3f} ratio")
    print(f"throughput: {res['throughput_req_s']:.1f} req/s")
    print(f"sim_wall_s: {time.perf_counter() - t0:.1f} s")
