"""bf16 linear layers on the CPU, SmolLM2's shapes: ``F.linear`` (oneDNN re-lays the weight on
every call), oneDNN on the prepacked weight and kvcore's native small-batch kernel
(``kvcore_kernels.linear_cpu``), the two kvcore's eager CPU forward uses
(``kvcore.models.layers.linear``).

Per shape (weight warm in the caches): the row counts of decode (1-64 running requests) and
prefill (256-2048 tokens), interleaved (A B C per repetition), median of ``--reps``; one line per
shape and row count, with how many outputs differ from ``F.linear``'s (oneDNN runs the same
kernel on its two paths, except another one for the LM head's single row; the native kernel sums
in another order: last-bit differences), then ``prepacked_speedup_min/max``.

A decode step (``--step``, the number that matters): the GEMMs of all 30 layers and the LM head
in order, so each weight streams from memory as in a real step (~270 MB), at 1-192 rows;
oneDNN prepacked (``F.linear`` for one row, as the forward did before) against the native
kernel, interleaved, median of ``--step-reps``; ``native_step_speedup_min/max``.

The gated gate-up (``--gated``): the 30 layers' gate-up weights (streaming from memory as in a
step) at 1-2,048 rows, the plain native product followed by ``ops_cpu.silu_and_mul`` against
the gated pack's one call (``linear_cpu.pack_linear(w, glu=True)``), outputs checked equal,
interleaved; ``gated_speedup_min/max``.

    python benches/bench_linear_cpu.py [--threads 2] [--reps 40] [--step-reps 9] [--no-shapes]
        [--gated]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_attention import interleaved
from kvcore.models.layers.linear import can_prepack
from kvcore_kernels import linear_cpu, ops_cpu

# (name, in, out): SmolLM2-135M's fused q/k/v, o, fused gate/up, down and the LM head
SHAPES = [
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
]
ROWS = [1, 4, 16, 48, 256, 2048]
STEP_ROWS = [1, 2, 4, 8, 16, 32, 48, 64, 128, 192]
LAYERS = 30


def decode_step(gen: torch.Generator, reps: int) -> list[float]:
    """Time SmolLM2's GEMMs of one step (30 layers' weights and the LM head, streaming from
    memory) at each row count: oneDNN against the native kernel. Returns the speedups."""
    layers = [
        [(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for _, k, n in SHAPES[:4]]
        for _ in range(LAYERS)
    ]
    layers.append([(torch.randn(49152, 576, generator=gen) * 576**-0.5).bfloat16()])
    dnn = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in ws] for ws in layers]
    small = [[linear_cpu.pack_linear(w) for w in ws] for ws in layers]
    weight_bytes = sum(w.numel() * 2 for ws in layers for w in ws)
    speedups = []
    for m in STEP_ROWS:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}

        def onednn(m=m, xs=xs) -> None:
            for ws, ps in zip(layers, dnn, strict=True):
                for w, p in zip(ws, ps, strict=True):
                    x = xs[w.shape[1]]
                    if m == 1:
                        F.linear(x, w)
                    else:
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

        def native(xs=xs) -> None:
            for ps in small:
                for p in ps:
                    linear_cpu.linear(xs[p.k], p)

        ms = interleaved({"onednn": onednn, "native": native}, reps)
        a, b = ms["onednn"][0] / 1e3, ms["native"][0] / 1e3
        speedups.append(a / b)
        print(
            f"decode step, {m:4d} rows: oneDNN {a * 1e3:6.2f} ms ({weight_bytes / a / 1e9:4.1f} "
            f"GB/s of weight), native {b * 1e3:6.2f} ms ({weight_bytes / b / 1e9:4.1f} GB/s), "
            f"speedup {a / b:4.2f}x",
            flush=True,
        )
    return speedups


GATED_ROWS = [1, 8, 48, 512, 2048]


def gated(gen: torch.Generator, reps: int) -> list[float]:
    """SmolLM2's 30 gate-up weights: plain native product + ``silu_and_mul`` against the gated
    pack, per row count; returns the speedups."""
    ws = [(torch.randn(3072, 576, generator=gen) * 576**-0.5).bfloat16() for _ in range(LAYERS)]
    plain = [linear_cpu.pack_linear(w) for w in ws]
    fused = [linear_cpu.pack_linear(w, glu=True) for w in ws]
    speedups = []
    for m in GATED_ROWS:
        x = torch.randn(m, 576, generator=gen).bfloat16()
        for p, g in zip(plain[:2], fused[:2], strict=True):
            want = ops_cpu.silu_and_mul(linear_cpu.linear(x, p))
            assert torch.equal(want, linear_cpu.linear(x, g))

        def two_steps(x=x) -> None:
            for p in plain:
                ops_cpu.silu_and_mul(linear_cpu.linear(x, p))

        def one_call(x=x) -> None:
            for g in fused:
                linear_cpu.linear(x, g)

        ms = interleaved({"two": two_steps, "gated": one_call}, reps)
        a, b = ms["two"][0] / LAYERS, ms["gated"][0] / LAYERS  # ms per layer
        speedups.append(a / b)
        print(
            f"gate-up + SiLU, {m:4d} rows: product + silu_and_mul {a * 1e3:8.1f} us, gated "
            f"{b * 1e3:8.1f} us, speedup {a / b:4.2f}x",
            flush=True,
        )
    return speedups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-reps", type=int, default=9)
    ap.add_argument("--no-shapes", action="store_true", help="only the decode-step table")
    ap.add_argument("--gated", action="store_true", help="and the gated gate-up table")
    args = ap.parse_args()
    if not can_prepack():
        raise SystemExit("this torch has no oneDNN packed linear (or KVCORE_PREPACK=0)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    native_ok = linear_cpu.fast_path()
    ratios = []
    for name, k, n in [] if args.no_shapes else SHAPES:
        w = torch.randn(n, k, generator=gen).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        small = linear_cpu.pack_linear(w)
        for m in ROWS:
            if name == "lm_head" and m > 48:
                continue  # logits only for the sampled rows
            x = torch.randn(m, k, generator=gen).bfloat16()

            def plain(x=x, w=w) -> torch.Tensor:
                return F.linear(x, w)

            def pre(x=x, packed=packed) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            def nat(x=x, small=small) -> torch.Tensor:
                return linear_cpu.linear(x, small)

            fns = {"plain": plain, "pre": pre, **({"native": nat} if native_ok else {})}
            a_out = plain()
            diffs = {}
            for label, fn in fns.items():
                out = fn()
                differ = int((a_out != out).sum())
                rel_err = (a_out.float() - out.float()).abs() / a_out.float().abs().clamp_min(1e-30)
                diffs[label] = (differ, float(rel_err.max()) if differ else 0.0)
            ms = interleaved(fns, args.reps)
            a, b = ms["plain"][0] / 1e3, ms["pre"][0] / 1e3  # medians, seconds
            ratios.append(a / b)
            native = ""
            if native_ok:
                c = ms["native"][0] / 1e3
                native = (
                    f", native {c * 1e6:8.1f} us ({b / c:4.2f}x prepacked; differing "
                    f"{diffs['native'][0]}, max rel {diffs['native'][1]:.1e})"
                )
            print(
                f"{name:8s} {k:5d}x{n:<6d} rows {m:5d}: F.linear {a * 1e6:8.1f} us, "
                f"prepacked {b * 1e6:8.1f} us, speedup {a / b:5.2f}x, "
                f"{2 * m * k * n / b / 1e9:6.1f} GFLOP/s, outputs differing {diffs['pre'][0]}/"
                f"{a_out.numel()} (max rel {diffs['pre'][1]:.1e}){native}"
            )
    if ratios:
        print(f"prepacked_speedup_min: {min(ratios):.2f} x")
        print(f"prepacked_speedup_max: {max(ratios):.2f} x")
    if native_ok:
        step = decode_step(gen, args.step_reps)
        print(f"native_step_speedup_min: {min(step):.2f} x")
        print(f"native_step_speedup_max: {max(step):.2f} x")
        if args.gated:
            fused = gated(gen, args.step_reps)
            print(f"gated_speedup_min: {min(fused):.2f} x")
            print(f"gated_speedup_max: {max(fused):.2f} x")
    else:
        print("native small-batch kernel: no AVX-512 BF16 on this CPU (not measured)")


if __name__ == "__main__":
    main()
