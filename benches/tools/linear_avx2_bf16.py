"""bf16 linear on an AVX2 CPU without a bf16 GEMM (Zen 3): the native kernel's AVX2 path on the
weight's bf16 pack (``kvcore_kernels.linear_cpu``) against oneDNN's packed fp32 linear and
``F.linear`` on the fp32 copy (what ``_upcast_linears`` runs), each output rounded to bf16, on
SmolLM2's shapes, interleaved, best of 7 rounds. Why: ``UPCAST_SMALL_ROWS`` in
``python/kvcore/models/layers/linear.py``; docs/engine.md.

    python benches/tools/linear_avx2_bf16.py [--threads 2] [--rows 1,2,4,8,16,48]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from kvcore_kernels import linear_cpu
from linear_fp32_onednn import SHAPES  # SmolLM2's shapes, name: (out features, in features)


def best_ms(fns, rounds: int = 7, calls: int = 5) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # interleaved
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: min(t) for name, t in times.items()}


def _calls(x, small, packed, w32) -> dict:
    return {
        "native": lambda: linear_cpu.linear(x, small),
        "packed": lambda: torch.ops.mkldnn._linear_pointwise(
            x.float(), packed, None, "none", [], "").to(torch.bfloat16),
        "flinear": lambda: F.linear(x.float(), w32).to(torch.bfloat16),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,48")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not linear_cpu.avx2_path():
        raise SystemExit("no AVX2 path here (AVX-512 BF16 CPUs take the AVX-512 one)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"# threads {args.threads}, seed {args.seed}; ms, GFLOP/s in brackets")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            if name == "lm_head" and rows > 64:  # the LM head sees only the sampled rows
                continue
            w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            w32 = w.float()
            packed = torch.ops.mkldnn._reorder_linear_weight(w32, 64)
            small = linear_cpu.pack_linear(w)
            ms = best_ms(_calls(x, small, packed, w32))
            gf = 2 * rows * n * k / 1e6
            dnn = min(ms["packed"], ms["flinear"])
            print(
                f"{rows:5d} rows {name:8s} native {ms['native']:8.3f} ({gf / ms['native']:6.1f})"
                f"  oneDNN packed fp32 {ms['packed']:8.3f} ({gf / ms['packed']:6.1f})"
                f"  F.linear fp32 {ms['flinear']:8.3f} ({gf / ms['flinear']:6.1f})"
                f"  oneDNN's best / native {dnn / ms['native']:5.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
