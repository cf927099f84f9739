"""bf16 linear layers on the CPU: ``F.linear`` (oneDNN re-lays the weight on every call) against
the prepacked weight kvcore's eager CPU forward uses (``kvcore.models.layers.linear``), SmolLM2's
shapes, for the row counts of decode (1-64 running requests) and prefill (256-2048 tokens).
Interleaved (A B per repetition), median of ``--reps``; prints one line per shape and row count
(with how many outputs differ between the two: oneDNN runs the same kernel on both, except a
different path for the LM head's single row: a few logits rounded differently) and
``prepacked_speedup_min/max``.

    python benches/bench_linear_cpu.py [--threads 2] [--reps 40]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_attention import interleaved
from kvcore.models.layers.linear import can_prepack

# (name, in, out): SmolLM2-135M's fused q/k/v, o, fused gate/up, down and the LM head
SHAPES = [
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
]
ROWS = [1, 4, 16, 48, 256, 2048]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not can_prepack():
        raise SystemExit("this torch has no oneDNN packed linear (or KVCORE_PREPACK=0)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    ratios = []
    for name, k, n in SHAPES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for m in ROWS:
            if name == "lm_head" and m > 48:
                continue  # logits only for the sampled rows
            x = torch.randn(m, k, generator=gen).bfloat16()

            def plain(x=x, w=w) -> torch.Tensor:
                return F.linear(x, w)

            def pre(x=x, packed=packed) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            a_out, b_out = plain(), pre()
            differ = int((a_out != b_out).sum())
            rel_err = (a_out.float() - b_out.float()).abs() / a_out.float().abs().clamp_min(1e-30)
            rel = float(rel_err.max()) if differ else 0.0
            ms = interleaved({"plain": plain, "pre": pre}, args.reps)
            a, b = ms["plain"][0] / 1e3, ms["pre"][0] / 1e3  # medians, seconds
            ratios.append(a / b)
            print(
                f"{name:8s} {k:5d}x{n:<6d} rows {m:5d}: F.linear {a * 1e6:8.1f} us, "
                f"prepacked {b * 1e6:8.1f} us, speedup {a / b:5.2f}x, "
                f"{2 * m * k * n / b / 1e9:6.1f} GFLOP/s, outputs differing {differ}/"
                f"{a_out.numel()} (max rel {rel:.1e})"
            )
    print(f"prepacked_speedup_min: {min(ratios):.2f} x")
    print(f"prepacked_speedup_max: {max(ratios):.2f} x")


if __name__ == "__main__":
    main()
