"""Prefix-cache trace benchmark through the Python batch API (issue 2).

    python benches/bench_prefix_cache.py --seed 0 --pool-blocks 65536 --block-size 16 --mode radix

Replays benches/workloads.prefix_trace (2,000 requests over 50 Zipf-popular system prompts,
40% conversation continuations, 32 in flight, batches of 8): per request a prefix lookup that
locks the hit and allocates the rest of prompt + output (evicting if short), and on completion
an insert of prompt + output and an unlock. Only the manager calls are timed. The peer (same
run) is the same replay through the pure-Python reference manager of tests/ in the same mode.
Prints `name: value unit` lines, including the hit rate an ideal (infinite) cache would get
at this block size and at token granularity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import kvcore  # noqa: E402
import workloads  # noqa: E402
from reference_manager import ReferenceManager  # noqa: E402


def flat(seqs) -> tuple[np.ndarray, np.ndarray]:
    offs = np.zeros(len(seqs) + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(s) for s in seqs])
    return np.concatenate(seqs).astype(np.uint32, copy=False), offs


def replay(reqs, steps, args) -> dict[str, float]:
    m = kvcore.KvCacheManager(args.pool_blocks, args.block_size, args.mode)
    bs = args.block_size
    # Batch arrays are built before the clock starts: only manager calls are timed.
    batches = []
    for kind, ids in steps:
        rid = np.array(ids, dtype=np.int64)
        if kind == "admit":
            toks, offs = flat([reqs[i].prompt for i in ids])
            total = np.array(
                [len(reqs[i].prompt) + len(reqs[i].output) for i in ids], dtype=np.int64
            )
            batches.append((kind, rid, toks, offs, total))
        else:
            toks, offs = flat([np.concatenate([reqs[i].prompt, reqs[i].output]) for i in ids])
            batches.append((kind, rid, toks, offs, None))
    timed = 0
    waste_num = waste_den = 0
    live: dict[int, int] = {}
    for kind, rid, toks, offs, total in batches:
        t0 = time.perf_counter_ns()
        if kind == "admit":
            got = m.admit(rid, total, toks, offs)
            m.drain_copy_ops()  # a step applies its copies before the forward
        else:
            m.free(rid, toks, offs)
        timed += time.perf_counter_ns() - t0
        if kind == "admit":
            if len(got) != len(rid):
                raise RuntimeError(f"admitted {len(got)} of {len(rid)}: pool too small")
            live.update(zip(rid.tolist(), total.tolist(), strict=True))
            waste_num += sum((-n) % bs for n in live.values())
            waste_den += int(round(m.usage * (m.num_blocks - 1))) * bs
        else:
            for r in rid.tolist():
                del live[r]
    m.check_invariants()
    s = m.stats()
    return {
        "ns": timed,
        "hit_rate": s["hit_tokens"] / s["query_tokens"],
        "evictions": s["evictions"],
        "copy_ops": s["copy_ops"],
        "waste_pct": 100.0 * waste_num / max(waste_den, 1),
    }


def replay_reference(reqs, steps, args) -> dict[str, float]:
    m = ReferenceManager(args.pool_blocks, args.block_size, args.mode)
    t0 = time.perf_counter_ns()
    for kind, ids in steps:
        for i in ids:
            r = reqs[i]
            if kind == "admit":
                total = len(r.prompt) + len(r.output)
                if m.admit(i, 0, r.prompt.tolist(), total) is None:
                    raise RuntimeError("reference: pool too small")
                m.drain_copy_ops()
            else:
                m.free(i, r.prompt.tolist() + r.output.tolist())
    return {
        "ns": time.perf_counter_ns() - t0,
        "hit_rate": m.stats["hit_tokens"] / m.stats["query_tokens"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool-blocks", type=int, default=65_536)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mode", choices=["radix", "hash", "off"], default="radix")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument(
        "--peer-requests",
        type=int,
        default=200,
        help="requests replayed through the (slow) pure-Python reference peer",
    )
    args = p.parse_args()
    if kvcore._kvcore.DEBUG_BUILD:
        sys.exit("refusing to benchmark a debug build: pip install -e . (release profile)")
    reqs = workloads.prefix_trace(args.seed, args.num_requests)
    steps = workloads.replay_order(len(reqs))
    n = len(reqs)
    res = replay(reqs, steps, args)
    rps = n / (res["ns"] * 1e-9)
    print(f"requests: {n} count")
    print(f"prompt_tokens: {sum(len(r.prompt) for r in reqs)} count")
    print(f"requests_per_s: {rps:.0f} req/s")
    print(f"us_per_request: {res['ns'] * 1e-3 / n:.2f} us")
    print(f"hit_rate: {res['hit_rate']:.4f} fraction")
    print(f"ideal_hit_rate: {workloads.ideal_hit_rate(reqs, steps, args.block_size):.4f} fraction")
    if args.block_size != 1:
        print(f"ideal_hit_rate_token: {workloads.ideal_hit_rate(reqs, steps, 1):.4f} fraction")
    print(f"evictions: {res['evictions']} count")
    print(f"copy_ops: {res['copy_ops']} count")
    print(f"waste_pct: {res['waste_pct']:.2f} %")
    if args.peer_requests > 0:
        k = min(args.peer_requests, n)
        sub_steps = workloads.replay_order(k)
        peer = replay_reference(reqs[:k], sub_steps, args)
        mine = replay(reqs[:k], sub_steps, args)
        peer_rps, mine_rps = k / (peer["ns"] * 1e-9), k / (mine["ns"] * 1e-9)
        assert abs(peer["hit_rate"] - mine["hit_rate"]) < 1e-12, (peer, mine)
        print(f"peer_python_reference_requests_per_s: {peer_rps:.0f} req/s (first {k} requests)")
        print(f"speedup_vs_python_reference: {mine_rps / peer_rps:.0f} x")


if __name__ == "__main__":
    main()
