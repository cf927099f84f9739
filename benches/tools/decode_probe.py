"""bf16 decode attention of the native kernel against a plain read of the same bytes, SmolLM2's
attention shape (GQA 9/3, head dim 64, blocks of 16, shuffled).

* ``step``: one decode step's attention as in the offline job: ``--layers`` caches of
  ``--batch`` requests x ``--keys`` keys, called in turn, so each layer's bytes were evicted by
  the others (cold); against ``max`` over an int16 tensor of as many bytes (a read at the speed
  the hardware prefetchers stream); then one layer repeated (warm).
* ``warm``: one layer at a time at several batch x key counts, median of 50 calls (~24 us of
  each is the Python call), in ns per key and KV head.

    python benches/tools/decode_probe.py [--threads 1] [--batch 48] [--keys 300] [--layers 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import kvcore_kernels as kk
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention_cpu import BS, HK, HQ, D, _paged  # noqa: E402


def _layer(gen, batch: int, keys: int):
    _, _, cache, table = _paged(gen, batch, keys, torch.bfloat16)
    lens = torch.full((batch,), keys, dtype=torch.int32)
    meta = kk.plan_attention(torch.arange(batch + 1, dtype=torch.int32), lens, table, BS)
    return torch.randn(batch, HQ, D, generator=gen).bfloat16(), cache, meta


def _call(layer) -> None:
    q, cache, meta = layer
    kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu")


def _median_s(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def step_probe(gen, batch: int, keys: int, n_layers: int) -> None:
    """One decode step's attention over ``n_layers`` caches (cold) against a plain read."""
    layers = [_layer(gen, batch, keys) for _ in range(n_layers)]
    nbytes = n_layers * 2 * batch * HK * keys * D * 2
    big = torch.ones(nbytes // 2, dtype=torch.int16)

    def step() -> None:
        for layer in layers:
            _call(layer)

    step()
    t, r = _median_s(step, 9), _median_s(big.max, 9)
    print(
        f"decode step attention: {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s), a plain read "
        f"of as many bytes {r * 1e3:.2f} ms ({nbytes / r / 1e9:.1f} GB/s): "
        f"{100 * r / t:.0f} % of it"
    )
    first = layers[0]
    _call(first)
    w = _median_s(lambda: _call(first), 20)
    gbs = nbytes / n_layers / w / 1e9
    print(f"one layer repeated (warm): {w * 1e3:.3f} ms ({gbs:.1f} GB/s)")


def warm_probe(gen, batch: int, keys: int) -> None:
    """One layer, warm, median of 50 calls."""
    layer = _layer(gen, batch, keys)
    for _ in range(5):
        _call(layer)
    w = _median_s(lambda: _call(layer), 50)
    nb = 2 * batch * HK * keys * D * 2
    print(
        f"warm B {batch:3d} x {keys:5d} keys: {nb / 1e6:6.2f} MB, {w * 1e3:.3f} ms, "
        f"{nb / w / 1e9:5.1f} GB/s, {w / (batch * keys * HK) * 1e9:.2f} ns per key and KV head"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    step_probe(gen, args.batch, args.keys, args.layers)
    for batch, keys in [(1, 16), (1, 2048), (4, 300), (4, 2400), (48, 300), (48, 1200)]:
        warm_probe(gen, batch, keys)


if __name__ == "__main__":
    main()
