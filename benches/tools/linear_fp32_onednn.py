"""fp32 linear on the CPU: torch's ``F.linear`` against oneDNN's packed fp32 linear
(``_reorder_linear_weight`` + ``_linear_pointwise``) on SmolLM2's shapes at 48 / 512 / 2,048
rows, best of 7 rounds of 5 calls each. Why: docs/engine.md, "Prepacked bf16 weights (CPU)".

    python benches/tools/linear_fp32_onednn.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # name: (out features, in features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def best_ms(fns: dict[str, Callable[[], torch.Tensor]], rounds: int = 7) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # interleaved
            fn()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            times[name].append((time.perf_counter() - t0) / 5 * 1e3)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = torch.ops.mkldnn
    for rows in (48, 512, 2048):
        for name, (n, k) in SHAPES.items():
            if name == "lm_head" and rows > 48:
                continue  # only sampled rows reach the LM head
            w, x = torch.randn(n, k), torch.randn(rows, k)
            packed = ops._reorder_linear_weight(w, rows)
            fns = {
                "F.linear": lambda x=x, w=w: F.linear(x, w),
                "onednn": lambda x=x, p=packed: ops._linear_pointwise(x, p, None, "none", [], ""),
            }
            assert torch.allclose(fns["F.linear"](), fns["onednn"](), atol=1e-3, rtol=1e-4)
            ms = best_ms(fns)
            gf = {key: 2 * rows * n * k / v / 1e6 for key, v in ms.items()}
            print(
                f"{rows:5d} rows {name:8s} F.linear {ms['F.linear']:8.3f} ms "
                f"({gf['F.linear']:6.1f} GFLOP/s), oneDNN packed {ms['onednn']:8.3f} ms "
                f"({gf['onednn']:6.1f}), F.linear / oneDNN {ms['F.linear'] / ms['onednn']:.2f}x"
            )


if __name__ == "__main__":
    main()
