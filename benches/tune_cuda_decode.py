"""Decode launch choices on a GPU, for the next lease: which BLOCK_N, num_warps, num_stages and
split count bring batch-1 and quantized decode at 32K towards bandwidth.

The first H200 run (2026-12-04, docs/kernels.md "First GPU run") read batch 1 x 32K at 20 % of a
device copy and every quantized format slower than bf16 at batch 8, with decode launched at
fixed choices (BLOCK_N 64, 4 warps, 2 stages, splits until 4 programs per SM). This script
times other choices on issue 16's shape (GQA 32/8, head dim 128, bf16 queries, 32K context,
batch 1 and 8) for the plain cache and the quantized formats, without changing the kernels: it
sets ``paged_triton.DECODE_NUM_STAGES`` / ``DECODE_NUM_WARPS`` and wraps ``block_shape`` (BLOCK_N
of decode tiles) and ``choose_num_splits`` (the SM count the split rule sees, times a factor).

Per config: the median of ``triton.testing.do_bench``, the bytes read against a device copy
measured in the same run, and the largest difference from the default config's output (a
config that changes the result is reported, never picked). Per shape and format it prints the
default's time and the best config's. Configs (``configs``) run in a fixed order until each format's
share of ``--budget`` seconds is spent (each new (BLOCK_N, warps, stages) compiles once per
format).

    python benches/tune_cuda_decode.py [--formats auto,fp8_e4m3,int8] [--budget 150]
    python benches/tune_cuda_decode.py --dry-run    # the interpreter, tiny shapes (no GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT = (64, 4, 2, 1.0)  # (BLOCK_N, num_warps, num_stages, SM factor): today's decode launch


def configs() -> list[tuple[int, int, int, float]]:
    """Today's choice first, then one axis changed at a time, then deeper pipelines with other
    split counts and warps, then wide tiles: the likeliest wins within a short budget."""
    one_axis = [(32, 4, 2, 1.0), (128, 4, 2, 1.0), (64, 8, 2, 1.0), (64, 4, 3, 1.0),
                (64, 4, 4, 1.0), (64, 4, 2, 0.5), (64, 4, 2, 2.0)]  # fmt: skip
    deeper = [(64, w, st, f) for w in (4, 8) for st in (3, 4) for f in (0.5, 2.0)]
    wide = [(128, 8, st, f) for st in (2, 3) for f in (1.0, 0.5)]
    return list(dict.fromkeys([DEFAULT, *one_axis, *deeper, *wide]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="auto,fp8_e4m3,int8")
    p.add_argument("--budget", type=float, default=150.0, help="seconds for all configs")
    p.add_argument("--dry-run", action="store_true", help="the interpreter, tiny shapes")
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before kvcore_kernels' Triton modules load
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_quant import build, cache_bytes, copy_gbps, timed
    from kvcore_kernels import paged_triton
    from kvcore_kernels.splits_triton import _num_sms, num_kv_splits

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        sys.exit("tune_cuda_decode: needs a GPU (or --dry-run)")
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    hq, hk, d, dtype = 32, 8, 128, torch.bfloat16
    shapes = [(1, 32768), (8, 32768)] if on_gpu else [(1, 40), (2, 40)]
    copy = copy_gbps(dev, 1 << 28 if on_gpu else 1 << 20, 1 if args.dry_run else 15, on_gpu)
    print(f"device: {dev}; copy_bandwidth: {copy:.0f} GB/s")

    base_shape, base_splits = paged_triton.block_shape, paged_triton.choose_num_splits
    chosen = {"block_n": None, "sm_factor": 1.0}

    def block_shape(decode_only, group, row_bytes):
        bm, bn = base_shape(decode_only, group, row_bytes)
        return (bm, chosen["block_n"] or bn) if decode_only else (bm, bn)

    def choose_num_splits(num_programs, max_keys, device, block_n=64):
        sms = max(1, int(_num_sms(device) * chosen["sm_factor"]))
        return num_kv_splits(num_programs, max_keys, sms, block_n)

    paged_triton.block_shape = block_shape
    paged_triton.choose_num_splits = choose_num_splits
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    formats = args.formats.split(",")
    for k, fmt in enumerate(formats):
        deadline = start + args.budget * (k + 1) / len(formats)  # each format its share
        for batch, ctx in shapes:
            attend = build(fmt, batch, ctx, hq, hk, d, dtype, dev, gen, "triton")[0]
            nbytes = cache_bytes(attend.args[1], batch, ctx)
            results, ref = [], None
            for bn, warps, stages, f in configs():
                if time.perf_counter() > deadline:
                    break
                chosen["block_n"], chosen["sm_factor"] = bn, f
                paged_triton.DECODE_NUM_WARPS, paged_triton.DECODE_NUM_STAGES = warps, stages
                try:
                    out = attend().float()
                    ms = timed({"x": attend}, 1 if args.dry_run else 15, on_gpu)["x"]
                except Exception as e:  # a config the compiler refuses (shared memory, ...)
                    print(f"{fmt} b{batch} bn{bn} w{warps} st{stages} sm{f}: failed: {e!r:.120}")
                    continue
                ref = out if ref is None else ref
                diff = (out - ref).abs().max().item()
                pct = 100 * nbytes / ms / 1e6 / copy
                results.append((ms, bn, warps, stages, f, diff))
                print(
                    f"{fmt} b{batch} x {ctx} bn{bn} w{warps} st{stages} sm{f}: {ms:.4f} ms, "
                    f"{pct:.1f} % of copy, diff {diff:.2e}"
                )
            if results:
                default = results[0]  # the first config is today's choice
                good = [r for r in results if r[5] < 2e-2]
                best = min(good, key=lambda r: r[0])
                print(
                    f"tune_{fmt}_b{batch}_ctx{ctx}: default {default[0]:.4f} ms, best "
                    f"{best[0]:.4f} ms (bn{best[1]} w{best[2]} st{best[3]} sm{best[4]}), "
                    f"{default[0] / best[0]:.2f}x"
                )
    paged_triton.block_shape, paged_triton.choose_num_splits = base_shape, base_splits
    print(f"tune_seconds: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
