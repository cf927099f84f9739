"""A decode step's K/V store + attention over 30 layers (SmolLM2's GQA 9/3, head dim 64, bf16,
256 cached tokens per request), through the checked entry points (``store_kv`` +
``paged_attention`` per layer) against ``step_calls.LayerCalls`` (checks once per step and
geometry), interleaved, medians; prints the time per layer and what the checks cost per step.

    python benches/bench_layer_calls.py [--threads 2] [--rounds 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import kvcore_kernels as kk
import torch
from kvcore_kernels import step_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from kernel_reference import make_batch  # noqa: E402

LAYERS = 30


def measure(batch: int, gen: torch.Generator, rounds: int) -> tuple[float, float]:
    """(checked, LayerCalls) median microseconds per layer at ``batch`` decode requests."""
    b = make_batch(gen, [(256, 1)] * batch, block_size=16, num_q_heads=9, num_kv_heads=3,
                   head_dim=64, dtype=torch.bfloat16)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 16)
    slots = b.block_table.long()[:, 256 // 16] * 16 + 256 % 16
    caches = [b.kv_cache.clone().nan_to_num_(0.0) for _ in range(LAYERS)]
    k = torch.randn(batch, 3, 64, generator=gen).bfloat16()
    v = torch.randn(batch, 3, 64, generator=gen).bfloat16()

    def checked() -> None:
        for cache in caches:
            kk.store_kv(k, v, cache, slots)
            kk.paged_attention(b.query, cache, meta, scale=0.125)

    def layer_calls() -> None:
        calls = step_calls.LayerCalls()
        for cache in caches:
            calls(b.query, k, v, cache, slots, meta, scale=0.125)

    times: dict[str, list[float]] = {"checked": [], "layer_calls": []}
    for _ in range(rounds):
        for name, fn in (("checked", checked), ("layer_calls", layer_calls)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / LAYERS * 1e6)
    return statistics.median(times["checked"]), statistics.median(times["layer_calls"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    for batch in (1, 4, 16, 48):
        a, c = measure(batch, gen, args.rounds)
        print(
            f"{batch:3d} requests x 256 tokens: checked {a:6.1f} us/layer, LayerCalls "
            f"{c:6.1f} us/layer: {a - c:5.1f} us/layer, {LAYERS * (a - c) / 1e3:.2f} ms per step",
            flush=True,
        )


if __name__ == "__main__":
    main()
