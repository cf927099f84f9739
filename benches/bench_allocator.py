"""Churn benchmark of the block allocator through the Python batch API (issue 2).

    python benches/bench_allocator.py --seed 0

Replays benches/workloads.churn (100,000 alloc/free ops of 1..4,096-token sequences, block
size 16, a 65,536-block pool held ~80% full) through kvcore.KvCacheManager with the prefix
cache off, radix and hash, and through a pure-Python free list (the peer, same run). Only the
manager calls are timed. ns_per_block = timed ns / blocks allocated (each block is also freed).
Prints `name: value unit` lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvcore  # noqa: E402
import workloads  # noqa: E402


class PyFreeList:
    """The peer: the simplest Python paged allocator (deque free list, dict of tables)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free_blocks = deque(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.bs = block_size

    def admit(self, ids: list[int], nums: list[int]) -> int:
        for i, (rid, n) in enumerate(zip(ids, nums, strict=True)):
            k = -(-n // self.bs)
            if k > len(self.free_blocks):
                return i
            pop = self.free_blocks.popleft
            self.tables[rid] = [pop() for _ in range(k)]
        return len(ids)

    def free(self, ids: list[int]) -> None:
        for rid in ids:
            self.free_blocks.extendleft(reversed(self.tables.pop(rid)))


def run_kvcore(rounds, args, mode: str, rng: np.random.Generator) -> dict[str, float]:
    m = kvcore.KvCacheManager(args.pool_blocks, args.block_size, mode)
    bs = args.block_size
    timed = 0
    blocks = 0
    waste_num = waste_den = 0
    live_tokens: dict[int, np.ndarray | int] = {}
    for rnd in rounds:
        if rnd.free:
            ids = np.array(rnd.free, dtype=np.int64)
            if mode == "off":
                t0 = time.perf_counter_ns()
                m.free(ids)
                timed += time.perf_counter_ns() - t0
            else:
                seqs = [live_tokens[r] for r in rnd.free]
                toks, offs = flat(seqs)
                t0 = time.perf_counter_ns()
                m.free(ids, toks, offs)
                timed += time.perf_counter_ns() - t0
            for r in rnd.free:
                del live_tokens[r]
        if rnd.alloc:
            ids = np.array([a[0] for a in rnd.alloc], dtype=np.int64)
            nums = np.array([a[1] for a in rnd.alloc], dtype=np.int64)
            if mode == "off":
                t0 = time.perf_counter_ns()
                got = m.admit(ids, nums)
                timed += time.perf_counter_ns() - t0
                for rid, n in rnd.alloc:
                    live_tokens[rid] = n
            else:
                seqs = [rng.integers(0, workloads.VOCAB, n, dtype=np.uint32) for _, n in rnd.alloc]
                toks, offs = flat(seqs)
                t0 = time.perf_counter_ns()
                got = m.admit(ids, nums, toks, offs)
                m.drain_copy_ops()  # a step applies its copies before the forward
                timed += time.perf_counter_ns() - t0
                for (rid, _), s in zip(rnd.alloc, seqs, strict=True):
                    live_tokens[rid] = s
            if len(got) != len(rnd.alloc):
                raise RuntimeError(f"{mode}: admitted {len(got)} of {len(rnd.alloc)}")
            blocks += int(np.sum(-(-nums // bs)))
            lens = [v if isinstance(v, int) else len(v) for v in live_tokens.values()]
            waste_num += sum((-n) % bs for n in lens)
            waste_den += int(round(m.usage * (m.num_blocks - 1))) * bs
    m.check_invariants()
    assert m.num_requests == 0 and m.usage == 0.0
    return {
        "ns": timed,
        "blocks": blocks,
        "waste_pct": 100.0 * waste_num / max(waste_den, 1),
        "evictions": m.stats()["evictions"],
    }


def flat(seqs) -> tuple[np.ndarray, np.ndarray]:
    offs = np.zeros(len(seqs) + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(s) for s in seqs])
    return np.concatenate(seqs).astype(np.uint32, copy=False), offs


def run_peer(rounds, args) -> dict[str, float]:
    a = PyFreeList(args.pool_blocks, args.block_size)
    timed = blocks = 0
    for rnd in rounds:
        t0 = time.perf_counter_ns()
        a.free(rnd.free)
        ok = a.admit([x[0] for x in rnd.alloc], [x[1] for x in rnd.alloc])
        timed += time.perf_counter_ns() - t0
        assert ok == len(rnd.alloc)
        blocks += sum(-(-n // args.block_size) for _, n in rnd.alloc)
    return {"ns": timed, "blocks": blocks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-ops", type=int, default=100_000)
    p.add_argument("--pool-blocks", type=int, default=65_536)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--modes", default="off,radix,hash", help="comma list of off,radix,hash")
    args = p.parse_args()
    if kvcore._kvcore.DEBUG_BUILD:
        sys.exit("refusing to benchmark a debug build: pip install -e . (release profile)")
    rounds = list(workloads.churn(args.seed, args.num_ops, args.pool_blocks, args.block_size))
    print(f"ops: {sum(len(r.free) + len(r.alloc) for r in rounds)} count")
    peer = run_peer(rounds, args)
    peer_ns = peer["ns"] / peer["blocks"]
    print(f"peer_python_freelist_ns_per_block: {peer_ns:.2f} ns")
    for mode in args.modes.split(","):
        res = run_kvcore(rounds, args, mode, np.random.default_rng(args.seed + 1))
        ns = res["ns"] / res["blocks"]
        suffix = "" if mode == "off" else f"_{mode}"
        print(f"ns_per_block{suffix}: {ns:.2f} ns")
        if mode == "off":
            print(f"blocks_allocated: {res['blocks']} count")
            print(f"waste_pct: {res['waste_pct']:.2f} %")
            print(f"speedup_vs_python_freelist: {peer_ns / ns:.1f} x")
        else:
            print(f"evictions{suffix}: {res['evictions']} count")


if __name__ == "__main__":
    main()
