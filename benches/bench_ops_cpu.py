"""The native bf16 element-wise ops of the forward against their torch twins
(``kvcore_kernels.ops_cpu``), at SmolLM2-135M's shapes: hidden 576, intermediate 1536, 9 query +
3 KV heads of 64. Rows: a decode step's (48) and a prefill chunk's (2048). Each op is timed in
rounds alternating twin and native; ``--repeats`` independent runs give the spread.

    python benches/bench_ops_cpu.py [--threads 2] [--repeats 3]

Prints ``op_<name>_<rows>: twin X us native Y us speedup Zx`` per run, then the worst speedup.
"""

from __future__ import annotations

import argparse

import torch
from bench_attention import interleaved
from kvcore_kernels import ops_cpu


def cases(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def bf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    x, res, w = bf(rows, 576, scale=3.0), bf(rows, 576), bf(576)
    gate_up = bf(rows, 2 * 1536, scale=3.0)
    qkv = bf(rows, 15 * 64)
    qk = qkv[:, : 12 * 64].unflatten(1, (12, 64))
    cos, sin = bf(rows, 32), bf(rows, 32)
    # the native RMSNorm and rotary write in place: each round works on fresh copies (both sides)
    return {
        "rms_norm_residual": (
            lambda: ops_cpu.rms_norm_torch(x.clone(), res.clone(), w, 1e-5),
            lambda: ops_cpu.rms_norm(x.clone(), res.clone(), w, 1e-5, backend="cpu"),
        ),
        "silu_and_mul": (
            lambda: ops_cpu.silu_and_mul_torch(gate_up),
            lambda: ops_cpu.silu_and_mul(gate_up, backend="cpu"),
        ),
        "rotary": (
            lambda: ops_cpu.rotary_torch(qk.clone(), cos, sin),
            lambda: ops_cpu.rotary_(qk.clone(), cos, sin, backend="cpu"),
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    worst: dict[str, float] = {}
    for rep in range(args.repeats):
        for rows in (48, 2048):
            for name, (twin, native) in cases(rows, rep).items():
                rounds = args.rounds if rows < 1000 else args.rounds // 4
                ms = interleaved({"twin": twin, "native": native}, rounds)
                t, n = ms["twin"][0] * 1e3, ms["native"][0] * 1e3  # medians, us
                key = f"op_{name}_{rows}"
                worst[key] = min(worst.get(key, float("inf")), t / n)
                print(f"{key}: twin {t:.0f} us native {n:.0f} us speedup {t / n:.2f}x")
    for key, s in worst.items():
        print(f"worst_speedup_{key.removeprefix('op_')}: {s:.2f}x")


if __name__ == "__main__":
    main()
