"""KV tiers benchmark (issue 10): a multi-turn chat workload whose working set is several times
the device pool, served with an unbounded pool, the pool alone, L2, L2+L3, and L4 from a cold
second process. Prints ``name: value unit`` lines.

Workload (seeded): ``--conversations`` (48) conversations of ``--turns`` (5) turns over 3 shared
system prompts of 500-1,000 tokens; each turn adds 100-300 user tokens to the history and the
model answers ``--output`` (8) greedy tokens that join the history. Turns are served in waves
(turn t of every conversation at once, in a seeded shuffled order), so the conversations'
histories compete for the pool; ``--arrival closed`` instead keeps ``--concurrency`` (48)
conversations in flight, each submitting its next turn when its answer is done, after
``--think-ms`` of user think time (the mean of seeded exponential draws, the same for every
configuration; default 0, a saturated loop) (benches/tiers_drive.py). ``--scale`` multiplies
every length (1.0 = the issue's sizes; CPU runs use a smaller scale, and say so in the ``scale``
line).

Timing (``--timing``): ``paired`` (default) runs the pool alone and the tiered engine in one
process, one step each in turn, and times each request on its own engine's steps, so that both
meet the same machine load; ``sequential`` runs one configuration after the other (wall-clock
TTFT from ``RequestOutput.metrics``; the unbounded, L2+L3 and L4 runs are always sequential).

Sizes: the working set is the KV of every conversation's final history (shared system prompts
once); the pool holds ``working_set / --pool-ratio`` (4.5) tokens; L2 holds the whole working set;
the L2+L3 run gets half of that in L2 and the rest on disk. The second process replays every
conversation's final turn cold (empty L1 and L2) against the Redis the first L4 run filled.

Lines: hit rates (prefix hit tokens / prompt tokens) per configuration, ``tiered_over_unbounded``,
TTFT p50 (and mean) of the pool alone and with L2, their ratio (``ttft_speedup``),
``remote_hit_fraction_second_process`` (prompt tokens of the second process fetched from L4 /
its prompt tokens), ``load_bw_fraction`` (L2->L1 load bandwidth / a plain torch ``copy_`` of
a mean load's bytes from the run's own L2 tensors into its pool tensors, after the run), and
``outputs_equal`` (1 when every configuration's greedy tokens are identical). ``--configs``
picks a subset (the pool alone and L2 always run; without the unbounded pool its lines print
nan and greedy outputs are compared against the pool alone's).

    python benches/bench_tiers.py --seed 0 [--model tiny|smollm2] [--remote redis://...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiers_drive import ChatDriver  # noqa: E402
from tiers_drive import run as run_drivers  # noqa: E402

MODELS = {"tiny": "tiny-llama", "smollm2": "smollm2-135m"}
# pool_only and tiered always run (the targets compare them); unbounded unless left out.
ALL_CONFIGS = ["unbounded", "pool_only", "tiered", "l2_l3", "l4_first"]


def make_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(system prompts, per-conversation user turns: a list of token lists)."""
    rng = np.random.default_rng(args.seed)
    s = args.scale
    systems = [
        rng.integers(100, 30000, int(rng.integers(500, 1001) * s)).tolist() for _ in range(3)
    ]
    convs = []
    for _ in range(args.conversations):
        turns = [
            rng.integers(100, 30000, max(1, int(rng.integers(100, 301) * s))).tolist()
            for _ in range(args.turns)
        ]
        convs.append(turns)
    return systems, convs


def make_llm(args, llm_kwargs, hook=None):
    from kvcore import LLM, SamplingParams

    llm = LLM(MODELS[args.model], block_size=args.block_size, max_num_seqs=16, **llm_kwargs)
    if hook is not None:
        hook(llm)
    return llm, SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)


def serve(args, systems, convs, llm_kwargs, only_last=False, hook=None):
    """Serve every turn (``--arrival``); returns (outputs per (conv, turn), wall-clock TTFTs,
    prompt tokens, llm). ``hook(llm)`` runs once the engine exists (tools/trace_tiers.py)."""
    llm, params = make_llm(args, llm_kwargs, hook)
    d = ChatDriver(llm, params, args, systems, convs, only_last=only_last)
    run_drivers([d])
    return d.outputs, d.ttft_wall, d.prompt_tokens, llm


def serve_paired(args, systems, convs, configs: dict, hook=None) -> dict:
    """Serve the same workload on one engine per config, their steps interleaved (one step
    each in turn) so that they meet the same load; TTFTs on each engine's own step clock
    (tiers_drive.py); ``hook(name, llm)`` as in ``serve``. Returns {name: (outputs, ttfts,
    prompt tokens, llm, seconds of its steps)}."""
    drivers, refs = {}, {}
    for name, kw in configs.items():
        llm, params = make_llm(args, kw, None if hook is None else lambda x, n=name: hook(n, x))
        if llm.engine.tiers is not None:
            refs[name] = PairedCopyReference(llm)
        drivers[name] = ChatDriver(llm, params, args, systems, convs)
    run_drivers(list(drivers.values()))
    steps = {k: d.clock - d.idle for k, d in drivers.items()}  # think time left out
    return {
        k: (d.outputs, d.ttft, d.prompt_tokens, d.llm, steps[k], refs.get(k))
        for k, d in drivers.items()
    }


def sizes(args, systems, convs) -> dict:
    """Working set, pool, L2 and the unbounded / pool-only / tiered engine arguments."""
    bs = args.block_size
    final = [
        sum(len(t) + args.output for t in turns) + len(systems[c % 3])
        for c, turns in enumerate(convs)
    ]
    shared = sum(len(s) for s in systems)
    working = sum(final) - shared * (len(convs) // 3 - 1)  # system prompts counted once
    longest = max(final)
    pool_blocks = max(int(working / args.pool_ratio) // bs, 3 * (longest // bs + 2)) + 2
    from kvcore import LLM

    probe = LLM(MODELS[args.model], num_blocks=4, block_size=bs)
    block_bytes = probe.engine.runner.kv_cache_bytes // 4
    del probe
    ws_bytes = (working // bs + len(convs)) * block_bytes
    return {
        "working": working,
        "pool_blocks": pool_blocks,
        "working_over_pool": working / (pool_blocks * bs),
        "block_bytes": block_bytes,
        "ws_bytes": ws_bytes,
        "configs": {
            "unbounded": {"num_blocks": 4 * (working // bs) + 64},
            "pool_only": {"num_blocks": pool_blocks},
            "tiered": {"num_blocks": pool_blocks, "host_kv_bytes": ws_bytes},
        },
    }


def hit_rate(llm) -> float:
    st = llm.engine.scheduler.stats()
    return st.prefix_hit_tokens / max(1, st.prefix_query_tokens)


def reference_copy_bw(tiers, blocks: int, repeats: int = 21) -> tuple[float, float]:
    """Bytes/s of two references moving ``blocks`` blocks from the run's L2 tensors into its
    pool tensors, every layer (the same bytes a mean load moves; the run is over, so the pool
    may be overwritten): a plain torch ``copy_`` of contiguous row ranges (the target's
    reference), and the torch gather + scatter (``index_select`` + ``index_copy_``) of random
    rows that loads used before ``copy_block_rows``. Source ranges rotate over L2. Each
    repeat is timed on its own and the median kept, so that one slow moment on a shared
    machine does not swing the reference (one timing of all repeats swung it tenfold)."""
    pool_rows, host_rows = tiers.layers[0].shape[0], tiers.host[0].shape[0]
    k = max(1, min(blocks, pool_rows - 1, host_rows))
    rng = np.random.default_rng(0)
    nbytes = k * tiers.block_bytes
    out = []
    for kind in ("plain", "gather"):
        rates = []
        for r in range(repeats):
            a = (r * k) % max(1, host_rows - k + 1)
            start = time.perf_counter()
            if kind == "plain":
                for rows, host in zip(tiers.layers, tiers.host, strict=True):
                    rows[1 : 1 + k].copy_(host[a : a + k])
            else:
                src = torch.as_tensor(rng.choice(host_rows, k, replace=False))
                dst = torch.as_tensor(rng.choice(np.arange(1, pool_rows), k, replace=False))
                for rows, host in zip(tiers.layers, tiers.host, strict=True):
                    rows.index_copy_(0, dst, host.index_select(0, src))
            rates.append(nbytes / (time.perf_counter() - start))
        out.append(float(np.median(rates)))
    return out[0], out[1]


class PairedCopyReference:
    """The load bandwidth's reference measured beside every load, in the same run and machine
    state: right after each step that loads ``n`` blocks from L2, a plain torch ``copy_`` of
    the same bytes (``n`` contiguous rows of a copy of L2 into ``n`` contiguous rows of a copy
    of the pool, every layer; copies, so that live KV is never overwritten). Source and
    destination ranges rotate, as a load's rows differ from one load to the next, so neither
    side is cache-hot from the previous copy. Wraps the engine's tier hook; the real load's own
    timing (``TierManager.load_seconds``) excludes the reference's time."""

    def __init__(self, llm):
        tiers = llm.engine.tiers
        self.tiers, self.seconds, self.bytes = tiers, 0.0, 0
        # Copies of L2 and of the pool, written through (clone) so that every page is mapped:
        # a first touch of a fresh page faults (tenfold slower), and an untouched page of a
        # zeroed tensor reads the shared zero page (cache-hot, too fast).
        self.src = [host.clone() for host in tiers.host]
        self.dst = [rows.clone() for rows in tiers.layers]
        self._src = self._dst = 0
        apply = tiers.apply

        def hooked(plan):
            apply(plan)
            n = len(plan.tier_load)
            if n:
                self.copy(n)

        tiers.apply = hooked
        llm.engine.runner.tier_hook = hooked

    def copy(self, n: int) -> None:
        host_rows, pool_rows = self.src[0].shape[0], self.dst[0].shape[0]
        n = min(n, host_rows, pool_rows)
        a = self._src if self._src + n <= host_rows else 0
        b = self._dst if self._dst + n <= pool_rows else 0
        start = time.perf_counter()
        for dst, src in zip(self.dst, self.src, strict=True):
            dst[b : b + n].copy_(src[a : a + n])
        self.seconds += time.perf_counter() - start
        self.bytes += n * self.tiers.block_bytes
        self._src, self._dst = a + n, b + n


def start_redis(workdir: str):
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tier_fixtures import RedisServer

    server = RedisServer(binary, workdir)
    server.start()
    return server, server.url


SECOND = """
import json, sys
sys.path.insert(0, sys.argv[2])
import bench_tiers as b
args = b.parse(json.loads(sys.argv[1]))
args.arrival, args.think_ms = "waves", 0.0  # every final turn at once, cold
args.reference = {tuple(map(int, k.split(","))): v for k, v in json.loads(sys.argv[3]).items()}
systems, convs = b.make_workload(args)
out, _, prompt_tokens, llm = b.serve(args, systems, convs, json.loads(sys.argv[4]), only_last=True)
fig = llm.engine.tier_figures()
print(json.dumps({"outputs": {f"{c},{t}": v for (c, t), v in out.items()},
                  "prompt_tokens": prompt_tokens, "l4": fig["tier_l4_fetched_tokens"],
                  "hit_rate": b.hit_rate(llm), "figures": fig}))
"""


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--remote", default=None, help="redis://... (default: start a local one)")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--output", type=int, default=8)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-ratio", type=float, default=4.5)
    ap.add_argument(
        "--arrival",
        choices=["waves", "closed"],
        default="waves",
        help="waves: turn t of every conversation at once; closed: --concurrency conversations "
        "in flight, each submitting its next turn when its answer is done",
    )
    ap.add_argument("--concurrency", type=int, default=48, help="closed loop: conversations")
    ap.add_argument(
        "--think-ms",
        type=float,
        default=0.0,
        help="closed loop: mean user think time between a turn's answer and the next turn "
        "(seeded exponential draws, on each engine's own clock; 0: none, a saturated loop)",
    )
    ap.add_argument(
        "--timing",
        choices=["paired", "sequential"],
        default="paired",
        help="paired: pool_only and tiered step in turn (same load, own-step clocks); "
        "sequential: one configuration after the other (wall clock)",
    )
    ap.add_argument(
        "--configs",
        type=lambda v: v.split(","),
        default=ALL_CONFIGS,
        help="comma-separated subset of " + ",".join(ALL_CONFIGS) + " (default: all)",
    )
    return ap.parse_args(argv)


def main() -> None:
    args = parse()
    torch.manual_seed(args.seed)
    systems, convs = make_workload(args)
    sz = sizes(args, systems, convs)
    pool_blocks, ws_bytes = sz["pool_blocks"], sz["ws_bytes"]
    print(f"scale: {args.scale} x")
    print(f"working_set_tokens: {sz['working']} tok")
    print(f"pool_tokens: {pool_blocks * args.block_size} tok")
    print(f"working_set_over_pool: {sz['working_over_pool']:.2f} x")
    block_bytes = sz["block_bytes"]
    tmp = tempfile.mkdtemp(prefix="kvcore-bench-tiers-")
    server, url = None, args.remote
    if url is None and "l4_first" in args.configs:
        server, url = start_redis(tmp)
    configs = dict(sz["configs"])
    configs["l2_l3"] = {
        "num_blocks": pool_blocks,
        "host_kv_bytes": ws_bytes // 2,
        "disk_path": str(Path(tmp) / "disk"),
        "disk_bytes": 4 * ws_bytes,
    }
    if url and "l4_first" in args.configs:
        configs["l4_first"] = {
            "num_blocks": pool_blocks,
            "host_kv_bytes": ws_bytes,
            "remote_url": url,
        }
    keep = set(args.configs) | {"pool_only", "tiered"}
    configs = {k: v for k, v in configs.items() if k in keep}
    results: dict = {}
    paired_ref: dict = {}

    def report(name, out, ttft, llm, seconds, what):
        if llm.engine.tiers is not None:
            llm.engine.tiers.close()
        results[name] = (out, ttft, llm)
        print(f"hit_rate_{name}: {hit_rate(llm):.4f} frac")
        print(f"ttft_p50_ms_{name}: {np.percentile(ttft, 50) * 1e3:.1f} ms")
        print(f"ttft_mean_ms_{name}: {np.mean(ttft) * 1e3:.1f} ms")
        print(f"{what}_{name}: {seconds:.1f} s")
        for k, v in llm.engine.tier_figures().items():
            if k in ("tier_l2_hit_tokens", "tier_l3_fetched_tokens", "tier_swap_outs"):
                print(f"{name}_{k}: {v} tok" if "tokens" in k else f"{name}_{k}: {v}")

    paired = ("pool_only", "tiered") if args.timing == "paired" else ()
    think = f"  think_ms: {args.think_ms:g}" if args.arrival == "closed" else ""
    print(f"timing: {args.timing}  arrival: {args.arrival}{think}")
    try:
        for name, kw in configs.items():
            if name in paired:
                continue
            start = time.perf_counter()
            out, ttft, _, llm = serve(args, systems, convs, kw)
            report(name, out, ttft, llm, time.perf_counter() - start, "wall_s")
        if paired:
            both = serve_paired(args, systems, convs, {k: configs[k] for k in paired})
            for name, (out, ttft, _, llm, clock, ref) in both.items():
                report(name, out, ttft, llm, clock, "engine_s")
                paired_ref[name] = ref
        ref = results["unbounded" if "unbounded" in results else "pool_only"][0]
        equal = all(r[0] == ref for r in results.values())
        second = None
        if url and "l4_first" in configs:
            kw = {"num_blocks": pool_blocks, "host_kv_bytes": ws_bytes, "remote_url": url}
            argv = sys.argv[1:]
            refs = json.dumps({f"{c},{t}": v for (c, t), v in ref.items()})
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    SECOND,
                    json.dumps(argv),
                    str(Path(__file__).parent),
                    refs,
                    json.dumps(kw),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            second = json.loads(done.stdout.strip().splitlines()[-1])
            for k, v in second["outputs"].items():
                c, t = map(int, k.split(","))
                equal &= v == ref[(c, t)]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    pool, tier = (hit_rate(results[k][2]) for k in ("pool_only", "tiered"))
    unb = hit_rate(results["unbounded"][2]) if "unbounded" in results else float("nan")
    print(f"hit_rate_unbounded: {unb:.4f} frac")
    print(f"hit_rate_pool_only: {pool:.4f} frac")
    print(f"hit_rate_tiered: {tier:.4f} frac")
    print(f"tiered_over_unbounded: {tier / unb:.4f} x  (target >= 0.90)")
    p_pool = np.percentile(results["pool_only"][1], 50) * 1e3
    p_tier = np.percentile(results["tiered"][1], 50) * 1e3
    print(f"ttft_p50_ms_pool_only: {p_pool:.1f} ms")
    print(f"ttft_p50_ms_tiered: {p_tier:.1f} ms")
    print(f"ttft_speedup: {p_pool / p_tier:.2f} x  (target >= 2)")
    m_pool, m_tier = (np.mean(results[k][1]) for k in ("pool_only", "tiered"))
    print(f"ttft_mean_speedup: {m_pool / m_tier:.2f} x  ({args.timing} timing)")
    if second is not None:
        frac = second["l4"] / max(1, second["prompt_tokens"])
        print(f"remote_hit_fraction_second_process: {frac:.4f} frac  (target >= 0.80)")
        print(f"hit_rate_second_process: {second['hit_rate']:.4f} frac")
        for k in ("tier_fetch_p50_ms", "tier_fetch_p95_ms", "tier_remote_failures"):
            print(f"second_process_{k}: {second['figures'][k]:g}")
    else:
        why = "l4_first not run" if "l4_first" not in args.configs else "no redis-server"
        print(f"remote_hit_fraction_second_process: nan frac  ({why})")
    tiers = results["tiered"][2].engine.tiers
    if tiers.load_seconds > 0:
        ours = tiers.bytes_loaded / tiers.load_seconds
        per_load = tiers.bytes_loaded // max(1, len(tiers.load_latency_s))
        ref = paired_ref.get("tiered")
        plain, gather = reference_copy_bw(tiers, max(1, per_load // block_bytes))
        print(f"blocks_per_load: {per_load / block_bytes:.1f} blocks")
        print(f"load_bw_gbps: {ours / 1e9:.3f} GB/s")
        print(f"plain_copy_after_run_bw_gbps: {plain / 1e9:.3f} GB/s")
        print(f"load_bw_fraction_after_run: {ours / plain:.4f} frac")
        print(f"torch_gather_scatter_bw_gbps: {gather / 1e9:.3f} GB/s")
        if ref is not None and ref.seconds > 0:  # paired: the reference beside every load
            plain = ref.bytes / ref.seconds
            print(f"plain_copy_paired_bw_gbps: {plain / 1e9:.3f} GB/s")
        print(f"load_bw_fraction: {ours / plain:.4f} frac  (target >= 0.50)")
    else:
        print("load_bw_fraction: nan frac  (no L2 load)")
    print(f"outputs_equal: {int(equal)} bool")


if __name__ == "__main__":
    main()
