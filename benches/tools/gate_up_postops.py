"""A SiLU MLP's gate-up above ``SMALL_ROWS`` (oneDNN's rows on an AMX CPU), SmolLM2's shape
(576 -> 2 x 1536): oneDNN's product ``[T, 3072]`` followed by ``ops_cpu.silu_and_mul`` ("two
steps") against two oneDNN GEMMs on the gate and up halves with SiLU and the product as
post-ops (``kvcore.models.layers.linear.gate_up_act``'s path). The 30 layers' weights in turn
(streaming, as in a step), rounds alternated, median per layer; the error of each against an
fp32 reference (max over outputs, relative to the largest) and the share of outputs that differ.

    python benches/tools/gate_up_postops.py [--threads 1] [--rows 65,128,256,512,1024,2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from kvcore_kernels import ops_cpu

LAYERS, K, INTER = 30, 576, 1536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="65,128,256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = torch.ops.mkldnn
    gen = torch.Generator().manual_seed(args.seed)
    ws = [(torch.randn(2 * INTER, K, generator=gen) * K**-0.5).bfloat16() for _ in range(LAYERS)]
    whole = [ops._reorder_linear_weight(w) for w in ws]
    halves = [tuple(ops._reorder_linear_weight(h.contiguous()) for h in w.chunk(2)) for w in ws]

    def two_steps(x, p):
        return ops_cpu.silu_and_mul(ops._linear_pointwise(x, p, None, "none", [], ""))

    def post_ops(x, gu):
        g = ops._linear_pointwise(x, gu[0], None, "swish", [], "")
        return ops._linear_pointwise.binary(x, g, gu[1], None, "mul")

    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, K, generator=gen).bfloat16()
        times: dict[str, list[float]] = {"two": [], "post": []}
        for _ in range(args.rounds):
            for name, fn, packs in (("two", two_steps, whole), ("post", post_ops, halves)):
                t0 = time.perf_counter()
                for p in packs:
                    fn(x, p)
                times[name].append((time.perf_counter() - t0) / LAYERS)
        a, b = (statistics.median(times[n]) * 1e3 for n in ("two", "post"))
        g, u = F.linear(x.float(), ws[0].float()).chunk(2, -1)
        ref = F.silu(g) * u
        y1, y2 = two_steps(x, whole[0]), post_ops(x, halves[0])
        e1, e2 = ((y.float() - ref).abs().max() / ref.abs().max() for y in (y1, y2))
        differ = 100 * (y1 != y2).float().mean()
        print(
            f"rows {rows:5d}: two steps {a:7.3f} ms, post-ops {b:7.3f} ms per layer, "
            f"speedup {a / b:.2f}x; max err vs fp32: two {e1:.2e}, post {e2:.2e}; "
            f"differing {differ:.1f} %"
        )


if __name__ == "__main__":
    main()
