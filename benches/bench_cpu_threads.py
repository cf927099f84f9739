"""How the native CPU kernel's threads live with torch's: each thread mode right after a matmul.

For 1 and 2 threads, rounds of ``matmul (torch's OpenMP team) -> kernel -> matmul``; wall-clock
medians and minima of the kernel call and of the matmul that follows it (slowed if the kernel's
threads still hold the cores). Modes: ``omp`` (torch's own OpenMP team via ``GOMP_parallel``),
``rayon`` (a rayon pool of the same size), ``single`` (the calling thread). The shape is the
issue-25 decode target (32 requests x 1,024 tokens, GQA 9/3, head dim 64, bf16).

    python benches/bench_cpu_threads.py [--rounds 40] [--batch 32] [--context 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvcore_kernels as kk
import torch
from bench_attention import paged_copy
from kvcore_kernels import cpu_native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    b, length = args.batch, args.context
    keys = torch.randn(b, 3, length, 64, generator=gen).bfloat16()
    values = torch.randn(b, 3, length, 64, generator=gen).bfloat16()
    cache, table = paged_copy(gen, keys, values, 16)
    q = torch.randn(b, 9, 64, generator=gen).bfloat16()
    lens = torch.full((b,), length, dtype=torch.int32)
    meta = kk.plan_attention(torch.arange(b + 1, dtype=torch.int32), lens, table, 16)
    x = torch.randn(512, 512)
    print(f"features: {cpu_native.features()}")
    print("| threads | mode | kernel ms (median / min) | next matmul ms (median / min) |")
    print("|---|---|---|---|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for mode in ("omp", "rayon", "single"):
            cpu_native.OPTIONS.mode = mode
            kern, mm = [], []
            for _ in range(args.rounds):
                x @ x
                t0 = time.perf_counter()
                kk.paged_attention(q, cache, meta, scale=0.125, backend="cpu")
                t1 = time.perf_counter()
                x @ x
                t2 = time.perf_counter()
                kern.append((t1 - t0) * 1e3)
                mm.append((t2 - t1) * 1e3)
            print(f"| {threads} | {mode} | {statistics.median(kern):.3f} / {min(kern):.3f} | "
                  f"{statistics.median(mm):.3f} / {min(mm):.3f} |")  # fmt: skip
            print(f"threads_{threads}_{mode}_kernel_ms: {statistics.median(kern):.3f}")


if __name__ == "__main__":
    main()
