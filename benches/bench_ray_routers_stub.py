"""The real Ray Serve routers over N stub replicas: balance and hit rate beyond 2 engines.

    python benches/bench_ray_routers_stub.py --replicas 8 --seed 0

``kvcore.tools.sim`` runs kvcore's routers but only a model of Ray's PrefixCacheAffinityRouter (its
router needs Serve and Ray actors). Here every router is the real Ray Serve one, routing
through a deployment handle: ``prefix`` (KvcoreRequestRouter), ``ray_prefix`` (Ray's
PrefixCacheAffinityRouter, Ray's defaults) and ``p2c`` (Ray's default). A stub replica costs
little memory: it keeps a prefix cache (``ReplicaTree``, kvcore's Rust radix tree, LRU) and,
one request at a time, sleeps ``--step-ms + --prefill-ms`` per uncached prompt token. The
stream: ``--systems`` system prompts (Zipf ``--zipf`` popularity) + a fresh user turn each,
Poisson arrivals at ``--rate`` per replica per second. Prints ``hit_rate_<router>``,
``latency_p50_ms_<router>`` (queue + stub prefill), ``imbalance_<router>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "kernels")]


def make_stream(args: argparse.Namespace) -> list[tuple[float, list[int]]]:
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(10, 30000, size=args.system_len).tolist() for _ in range(args.systems)]
    weights = 1.0 / np.arange(1, args.systems + 1) ** args.zipf
    n = args.requests_per_replica * args.replicas
    which = rng.choice(args.systems, size=n, p=weights / weights.sum())
    at = np.cumsum(rng.exponential(1.0 / (args.rate * args.replicas), size=n))
    user = [rng.integers(30000, 60000, size=args.user_len).tolist() for _ in range(n)]
    return [(float(at[i]), systems[which[i]] + user[i]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests-per-replica", type=int, default=60)
    ap.add_argument("--rate", type=float, default=3.0, help="arrivals per second per replica")
    ap.add_argument("--systems", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=0.5)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--prefill-ms", type=float, default=0.2, help="per uncached prompt token")
    ap.add_argument("--cache-blocks", type=int, default=512, help="stub cache, 16-token blocks")
    ap.add_argument("--threshold", type=int, default=2, help="kvcore prefix router slack")
    args = ap.parse_args()

    import ray
    from kvcore.scaleout.ray_app import ROUTERS
    from kvcore.scaleout.ray_ingress import RoutedRequest
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
    class StubReplica:
        def __init__(self, step_ms: float, prefill_ms: float, blocks: int):
            from kvcore.scaleout.router import ReplicaTree

            self.cache, self.lock = ReplicaTree(blocks, 16), asyncio.Lock()
            self.step_s, self.prefill_s = step_ms / 1000, prefill_ms / 1000
            self.name = serve.get_replica_context().replica_id.unique_id

        async def complete(self, req: RoutedRequest) -> tuple[str, int]:
            ids = np.asarray(req.token_ids, np.uint32)
            async with self.lock:  # one engine: prefills run one after another
                hit = self.cache.match(ids)
                self.cache.insert(ids)
                await asyncio.sleep(self.step_s + self.prefill_s * (len(ids) - hit))
            return self.name, hit

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "kernels")])
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=80 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE"}},
    )
    stream = make_stream(args)
    print(
        f"# {len(stream)} requests at {args.rate}/s per replica, {args.replicas} stub replicas, "
        f"{args.systems} system prompts of {args.system_len} tokens (zipf {args.zipf}), "
        f"seed {args.seed}"
    )
    for name, router in (("prefix", "prefix"), ("ray_prefix", "ray-prefix"), ("p2c", "ray-p2c")):
        cls, kwargs = ROUTERS[router]
        opts: dict = {"num_replicas": args.replicas}
        if router == "prefix":
            kwargs = {**kwargs, "threshold": args.threshold, "seed": args.seed}
        if cls is not None:
            opts["request_router_config"] = RequestRouterConfig(
                request_router_class=cls, request_router_kwargs=kwargs
            )
        app = StubReplica.options(**opts).bind(args.step_ms, args.prefill_ms, args.cache_blocks)
        handle = serve.run(app, name=name, route_prefix=None)

        async def drive(handle=handle):
            start = time.perf_counter()

            async def one(t: float, ids: list[int]):
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
                t0 = time.perf_counter()
                where, hit = await handle.complete.remote(RoutedRequest("completion", b"", ids))
                return where, hit, time.perf_counter() - t0

            return await asyncio.gather(*(one(t, ids) for t, ids in stream))

        results = asyncio.run(drive())
        serve.delete(name)
        counts = Counter(w for w, _, _ in results)
        per = [counts.get(k, 0) for k in counts] + [0] * (args.replicas - len(counts))
        hit = sum(h for _, h, _ in results) / sum(len(ids) for _, ids in stream)
        lat = 1000 * np.array([s for _, _, s in results])
        print(f"hit_rate_{name}: {hit:.4f} ratio")
        print(f"latency_p50_ms_{name}: {np.percentile(lat, 50):.1f} ms")
        print(f"latency_p95_ms_{name}: {np.percentile(lat, 95):.1f} ms")
        print(f"imbalance_{name}: {max(per) / np.mean(per):.3f} ratio")
        print(f"replicas_used_{name}: {len(counts)} count", flush=True)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
