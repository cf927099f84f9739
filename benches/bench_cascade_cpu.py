"""Decode over a shared prefix on the CPU: the native kernel with and without cascade items.

A decode step of ``--batch`` requests whose block tables start with the same ``--prefix`` cached
tokens (what the radix cache hands out for a shared system prompt), each followed by 64-192 tokens
of its own; GQA 9/3, head dim 64, bf16, block 16 (SmolLM2's shape). ``--layers`` caches are
called in turn, as a model's layers are, so each call finds its K/V out of cache as in the
engine. Without cascade every request reads the prefix's K/V itself; with it (the default,
``KVCORE_NATIVE_CASCADE``), one item per run of up to 16 requests reads it once and each request
merges that partial with its own keys' (FlashInfer's cascade attention). Rounds alternate the
two; medians (and minima) of one layer's call, the ratio, and the largest output difference.

    python benches/bench_cascade_cpu.py [--batch 48] [--prefix 512] [--threads 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvcore_kernels as kk
import torch
from kvcore_kernels import cpu_native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--prefix", type=int, default=512, help="shared tokens (whole blocks)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    bs, hq, hk, d = 16, 9, 3, 64
    own = torch.randint(64, 193, (args.batch,), generator=gen)
    lens = args.prefix + own
    pre = args.prefix // bs
    per_req = (-(-lens // bs)).tolist()
    num_blocks = 1 + pre + sum(n - pre for n in per_req)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shared = [ids.pop() for _ in range(pre)]
    table = torch.zeros(args.batch, max(per_req), dtype=torch.int32)
    for r, n in enumerate(per_req):
        table[r, :n] = torch.tensor(shared + [ids.pop() for _ in range(n - pre)])
    caches = [
        torch.randn(num_blocks, 2, bs, hk, d, generator=gen).to(torch.bfloat16)
        for _ in range(args.layers)
    ]
    query = torch.randn(args.batch, hq, d, generator=gen).to(torch.bfloat16)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32)
    meta = kk.plan_attention(qsl, lens.to(torch.int32), table, bs)
    outs = {True: torch.empty_like(query), False: torch.empty_like(query)}
    layer = {True: 0, False: 0}

    def call(cascade: bool):
        def fn() -> None:
            cpu_native.OPTIONS.cascade = cascade
            cache = caches[layer[cascade] % args.layers]
            layer[cascade] += 1
            kk.paged_attention(query, cache, meta, scale=d**-0.5, backend="cpu",
                               out=outs[cascade])  # fmt: skip

        return fn

    fns = {"cascade": call(True), "per_request": call(False)}
    for fn in fns.values():  # a pass over every layer, so the timed rounds start alike
        for _ in range(args.layers):
            fn()
    # Rounds alternate which side goes first (A B, B A, ...): the first call after the other
    # side's showed a ~15 % bias at small sizes when one side always went first.
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for k in range(args.rounds * args.layers):
        for name in order if k % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
    res = {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}
    cpu_native.OPTIONS.cascade = True
    work = cpu_native.work_for(meta, None, hk, hq // hk, d, args.threads)
    kv_bytes = 2 * hk * d * 2
    read_off = int(lens.sum()) * kv_bytes
    read_on = (int(own.sum()) + -(-args.batch // 16) * args.prefix) * kv_bytes
    diff = (outs[True].float() - outs[False].float()).abs().max().item()
    print(f"case: batch {args.batch} x (prefix {args.prefix} + own 64-192), GQA 9/3, d 64, bf16, "
          f"{args.layers} layer caches, {args.threads} threads, seed {args.seed}")  # fmt: skip
    print(f"cascade_requests: {work.cascade_requests}")
    for name, (med, lo) in res.items():
        print(f"{name}_ms: {med:.3f} (min {lo:.3f})")
    print(f"kv_mb_read: per_request {read_off / 1e6:.1f}, cascade {read_on / 1e6:.1f}")
    print(f"speedup_cascade: {res['per_request'][0] / res['cascade'][0]:.2f}x")
    print(f"max_abs_diff: {diff:.4f}")


if __name__ == "__main__":
    main()
