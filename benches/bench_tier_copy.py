"""L2 -> L1 load copies on the CPU, four ways, on the same bytes (docs/tiers.md, "Profile").

``--blocks`` random (L2 slot, pool block) pairs over ``--layers`` layers of ``--row-kib`` KiB
rows (tiny-llama, block 16: 8 layers x 16 KiB); L2 holds ``--host-blocks`` slots so sources are
not cache-hot. Lines (GB/s, median of ``--repeats``): ``plain_copy`` (one contiguous torch
``copy_`` of the same byte count: the reference), ``plain_copy_layers`` (contiguous row ranges,
layer by layer), ``copy_block_rows`` (what loads use: one pass per row, Rust),
``gather_scatter`` (``index_select`` + ``index_copy_``: what loads used before), and the
fraction of the reference each reaches.

    python benches/bench_tier_copy.py [--blocks 128] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from kvcore._kvcore import copy_block_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--row-kib", type=int, default=16)
    ap.add_argument("--host-blocks", type=int, default=4000)
    ap.add_argument("--pool-blocks", type=int, default=420)
    ap.add_argument("--repeats", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    row, n, nh, npool = args.row_kib << 10, args.blocks, args.host_blocks, args.pool_blocks
    torch.manual_seed(args.seed)
    host = [torch.randint(0, 255, (nh, row), dtype=torch.uint8) for _ in range(args.layers)]
    pool = [torch.zeros((npool, row), dtype=torch.uint8) for _ in range(args.layers)]
    host64, pool64 = [h.view(torch.int64) for h in host], [p.view(torch.int64) for p in pool]
    hnp, pnp = [h.numpy() for h in host], [p.numpy() for p in pool]
    nbytes = n * row * args.layers
    src_flat = torch.randint(0, 255, (8 * nbytes,), dtype=torch.uint8)
    dst_flat = torch.zeros_like(src_flat)
    rng = np.random.default_rng(args.seed)
    threads = torch.get_num_threads()

    def plain(i, s, d):
        a = (i % 8) * nbytes
        dst_flat[a : a + nbytes].copy_(src_flat[a : a + nbytes])

    def plain_layers(i, s, d):
        a, b = int(s[0]) % (nh - n), int(d[0]) % (npool - n)
        for h, p in zip(host64, pool64, strict=True):
            p[b : b + n].copy_(h[a : a + n])

    def rows(i, s, d):
        copy_block_rows(pnp, hnp, np.stack([s, d], 1).astype(np.int32), threads=threads)

    def gather(i, s, d):
        si, di = torch.as_tensor(s), torch.as_tensor(d)
        for h, p in zip(host64, pool64, strict=True):
            p.index_copy_(0, di, h.index_select(0, si))

    ways = {
        "plain_copy": plain,
        "plain_copy_layers": plain_layers,
        "copy_block_rows": rows,
        "gather_scatter": gather,
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(args.repeats):  # interleaved, so a noisy moment hits every way
        s, d = rng.choice(nh, n, replace=False), rng.choice(npool, n, replace=False)
        for name, f in ways.items():
            start = time.perf_counter()
            f(i, s, d)
            times[name].append(time.perf_counter() - start)
    bw = {k: nbytes / float(np.median(v)) for k, v in times.items()}
    print(f"bytes_per_load: {nbytes} B")
    for k, v in bw.items():
        print(f"{k}_gbps: {v / 1e9:.3f} GB/s")
    for k in ("copy_block_rows", "gather_scatter"):
        print(f"{k}_fraction: {bw[k] / bw['plain_copy']:.3f} frac")


if __name__ == "__main__":
    main()
