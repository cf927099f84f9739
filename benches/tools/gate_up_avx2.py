"""The gated gate-up against its two steps on the native kernel, SmolLM2's shape (K 576, 2I
3,072), per call: ``linear`` on the gated pack (``silu(g) * u`` from the sums) against
``linear`` on the plain pack then ``ops_cpu.silu_and_mul``. The 30 layers' weights are cycled
(each call's weight streams from memory, as in a step), the two alternated call by call; the
median of ``--reps`` rounds over the 30 layers, per layer.

    python benches/tools/gate_up_avx2.py [--threads 1] [--rows 1,8,48,512,2048] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvcore_kernels import linear_cpu, ops_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,48,512,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    scale = 576**-0.5
    ws = [(torch.randn(3072, 576, generator=gen) * scale).bfloat16() for _ in range(args.layers)]
    plain = [linear_cpu.pack_linear(w) for w in ws]
    gated = [linear_cpu.pack_linear(w, glu=True) for w in ws]
    print(f"# {args.threads} thread(s), {args.layers} layers cycled, median of {args.reps} rounds")
    print("| rows | product + silu_and_mul, per layer | gated, one call | speedup |")
    print("|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        two = lambda p, x=x: ops_cpu.silu_and_mul(linear_cpu.linear(x, p))  # noqa: E731
        one = lambda p, x=x: linear_cpu.linear(x, p)  # noqa: E731
        assert torch.equal(two(plain[0]), one(gated[0]))
        t_two, t_one = [], []
        for _ in range(args.reps):
            for f, packs, out in ((two, plain, t_two), (one, gated, t_one)):
                t0 = time.perf_counter()
                for p in packs:
                    f(p)
                out.append((time.perf_counter() - t0) / len(packs))
        a, b = statistics.median(t_two), statistics.median(t_one)
        print(f"| {rows} | {a * 1e6:.1f} us | {b * 1e6:.1f} us | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
