"""Scale-out bench: N replicas of the tiny model on Ray Serve, prefix routing vs power-of-two.

    python benches/bench_scale_out.py --replicas 2 --seed 0

One local Ray; for each layout a fresh Serve app (cold caches) gets the same shared-prefix chat
stream (``--systems`` system prompts of ``--system-len`` tokens, a fresh user turn each, Poisson
arrivals at ``--rate``/s, streamed, ``return_token_ids``):

- ``prefix``: kvcore's prefix router (KvcoreRequestRouter) over N replicas;
- ``ray_prefix``: Ray Serve LLM's ``PrefixCacheAffinityRouter`` over the same N replicas, with
  Ray's defaults (``--ray-imbalanced-threshold`` sets its balance threshold);
- ``p2c``: Ray Serve's default ``PowerOfTwoChoicesRequestRouter`` over the same N replicas;
- ``single``: one replica with N times the KV blocks (one cache as large as all of theirs).

Hit rate: cached prompt tokens (``usage.prompt_tokens_details``) over prompt tokens. TTFT: the
client's time to the first chunk carrying a token. Imbalance: the busiest replica's finished
requests (``/metrics``, ``request_success_total{replica}``) over the mean. Not a timed test; on
a shared 2-core machine the latencies are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "kernels"), str(ROOT / "tests")]


def make_stream(args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(10, 32000, size=args.system_len).tolist() for _ in range(args.systems)]
    at = np.cumsum(rng.exponential(1.0 / args.rate, size=args.requests))
    out = []
    for t in at:
        user = rng.integers(10, 32000, size=int(rng.integers(*args.user_len))).tolist()
        out.append((float(t), systems[int(rng.integers(args.systems))] + user))
    return out


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], args):
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, cached, times, n_out = time.perf_counter(), None, None, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                times.append(time.perf_counter())
                n_out += len(chunk["choices"][0]["token_ids"])
                ttft = times[0] - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if ttft is None or cached is None:
        raise RuntimeError("stream ended without a token or usage")
    return ttft, cached, list(np.diff(times)), n_out


async def drive(url: str, stream, args):
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()

        async def at(t: float, prompt: list[int]):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await one(client, url, prompt, args)

        results = await asyncio.gather(*(at(t, p) for t, p in stream))
        span = time.perf_counter() - start
    itl = [x for r in results for x in r[2]]
    tok_s = sum(r[3] for r in results) / span
    return [r[0] for r in results], sum(r[1] for r in results), itl, tok_s


def replica_counts(url: str) -> list[float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if fam.name.endswith(":request_success"):
            for s in fam.samples:
                counts[s.labels["replica"]] = counts.get(s.labels["replica"], 0) + s.value
    return list(counts.values())


def run_layout(name, replicas, router, blocks, stream, args, port, prefill=0, extra=()):
    from kvcore.scaleout.ray_app import build_app
    from ray import serve

    argv = ["--model", "tiny-llama", "--num-blocks", str(blocks), "--threads", "1"]
    argv += ["--max-model-len", str(args.system_len + args.user_len[1] + args.max_tokens + 16)]
    argv += ["--seed", str(args.seed), *extra]
    kwargs = (
        {"threshold": args.threshold, "rel_threshold": args.rel_threshold}
        if router == "prefix"
        else None
    )
    if router == "ray-prefix" and args.ray_imbalanced_threshold is not None:
        kwargs = {"imbalanced_threshold": args.ray_imbalanced_threshold}
    app = build_app(
        argv,
        replicas=replicas,
        router=router,
        router_kwargs=kwargs,
        hub_name=f"hub-{name}",
        prefill_replicas=prefill,
    )
    serve.run(app, name=name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    ttfts, cached, itl, tok_s = asyncio.run(drive(url, stream, args))
    time.sleep(2.5)  # the replicas push /metrics every second
    counts = replica_counts(url)
    serve.delete(name)
    prompt_tokens = sum(len(p) for _, p in stream)
    imbalance = max(counts) / (sum(counts) / len(counts)) if counts else float("nan")
    return {
        "hit_rate": cached / prompt_tokens,
        "ttft_p50_ms": 1000 * float(np.percentile(ttfts, 50)),
        "ttft_p95_ms": 1000 * float(np.percentile(ttfts, 95)),
        "imbalance": imbalance,
        "itl_p95_ms": 1000 * float(np.percentile(itl, 95)) if itl else float("nan"),
        "output_tok_s": tok_s,
        "replicas_seen": len(counts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rate", type=float, default=3.0, help="arrivals per second")
    ap.add_argument("--systems", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, nargs=2, default=(16, 48))
    ap.add_argument("--max-tokens", type=int, default=4)
    # 600 blocks hold a replica's share of the 32 system prompts (16 x 32 blocks) and its running
    # requests, not all 32: spreading every prompt over every replica (p2c) thrashes the cache.
    ap.add_argument("--num-blocks", type=int, default=600, help="KV blocks per replica")
    ap.add_argument("--threshold", type=int, default=2)
    ap.add_argument("--rel-threshold", type=float, default=1.5)
    ap.add_argument(
        "--ray-imbalanced-threshold",
        type=float,
        default=None,
        help="ray_prefix: PrefixCacheAffinityRouter's imbalanced_threshold (default Ray's: inf)",
    )
    ap.add_argument(
        "--disagg",
        action="store_true",
        help="instead: aggregated (N replicas) vs disaggregated (1 prefill + N-1 decode), "
        "both on a shared Redis tier",
    )
    args = ap.parse_args()
    t_start = time.perf_counter()

    import ray
    from ray import serve
    from serve_util import free_port

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=100 << 20,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": f"{ROOT / 'python'}{os.pathsep}{ROOT / 'kernels'}"}
        },
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stream = make_stream(args)
    n, blocks = args.replicas, args.num_blocks
    if args.disagg:
        return disagg(args, stream, port)
    layouts = [("prefix", n, "prefix", blocks), ("ray_prefix", n, "ray-prefix", blocks)]
    layouts.append(("p2c", n, "ray-p2c", blocks))
    layouts.append(("single", 1, "ray-p2c", blocks * n))
    print(
        f"# {args.requests} requests at {args.rate}/s, {args.systems} system prompts of "
        f"{args.system_len} tokens, {n} replicas x {blocks} KV blocks, seed {args.seed}, "
        f"prefix router threshold {args.threshold} / x{args.rel_threshold:g}"
    )
    res = {}
    for name, replicas, router, nb in layouts:
        res[name] = run_layout(name, replicas, router, nb, stream, args, port)
        r = res[name]
        print(f"hit_rate_{name}: {r['hit_rate']:.4f} ratio", flush=True)
        print(f"ttft_p50_ms_{name}: {r['ttft_p50_ms']:.1f} ms", flush=True)
        print(f"ttft_p95_ms_{name}: {r['ttft_p95_ms']:.1f} ms", flush=True)
        print(f"imbalance_{name}: {r['imbalance']:.3f} ratio", flush=True)
    q, s = res["p2c"], res["single"]
    for name in ("prefix", "ray_prefix"):
        p = res[name]
        print(f"hit_rate_{name}_over_single: {p['hit_rate'] / s['hit_rate']:.3f} x")
        print(f"hit_rate_{name}_over_p2c: {p['hit_rate'] / q['hit_rate']:.3f} x")
        print(f"ttft_p50_p2c_over_{name}: {q['ttft_p50_ms'] / p['ttft_p50_ms']:.3f} x")
    p, r = res["prefix"], res["ray_prefix"]
    print(f"hit_rate_prefix_over_ray_prefix: {p['hit_rate'] / r['hit_rate']:.3f} x")
    print(f"ttft_p50_ray_prefix_over_prefix: {r['ttft_p50_ms'] / p['ttft_p50_ms']:.3f} x")
    print(f"bench_wall_s: {time.perf_counter() - t_start:.0f} s")
    serve.shutdown()
    ray.shutdown()


def disagg(args, stream, port: int) -> None:
    """Aggregated vs disaggregated prefill on one Redis: TTFT p95, ITL p95, output tokens/s."""
    import shutil
    import tempfile

    from ray import serve
    from tier_fixtures import RedisServer

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("--disagg needs redis-server")
    n = args.replicas
    print(
        f"# disaggregation: {args.requests} requests at {args.rate}/s, {args.max_tokens} output "
        f"tokens, aggregated {n} replicas vs 1 prefill + {n - 1} decode, seed {args.seed}"
    )
    for name, replicas, prefill in (("agg", n, 0), ("disagg", n - 1, 1)):
        with tempfile.TemporaryDirectory() as tmp:
            redis = RedisServer(binary, tmp)
            redis.start()  # a fresh store per layout
            try:
                extra = ("--host-kv-mb", "16", "--remote-url", redis.url)
                r = run_layout(
                    name, replicas, "prefix", args.num_blocks, stream, args, port, prefill, extra
                )
            finally:
                redis.stop()
        for key, unit in (
            ("ttft_p50_ms", "ms"),
            ("ttft_p95_ms", "ms"),
            ("itl_p95_ms", "ms"),
            ("output_tok_s", "tok/s"),
            ("hit_rate", "ratio"),
        ):
            print(f"{key}_{name}: {r[key]:.4g} {unit}", flush=True)
    serve.shutdown()


if __name__ == "__main__":
    main()
