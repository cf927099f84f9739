"""Quantized KV cache benchmark: ``name: value unit`` lines, each format against the model-dtype
cache measured in the same run.

``--device cpu`` (default): the torch twins, SmolLM2's attention shape (9 / 3 heads, head_dim
64, fp32), decode of ``--batch`` requests x ``--context`` tokens: attention per step and the
quantizing store of one token per request, per format; the ratio is format / "auto".

``--device cuda``: the Triton kernels, decode at 32K tokens (GQA 32 / 8, head_dim 128, bf16 —
an 8B-class layer), batch 1 and 8: every format's decode step against the bf16 cache's, plus
achieved bandwidth (cache bytes read / time). Target: fp8 at least 1.7x faster than bf16.
Also: every format's bandwidth as % of a device copy measured in the same run (target 80%),
the quantizing store against the bf16 store (target <= 1x), the Triton output against the torch
twin's. ``--dry-run`` runs the CUDA path's plumbing under the Triton interpreter at tiny shapes
(one round; its numbers mean nothing).

Needs only ``kvcore_kernels`` on the path (no kvcore extension).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

FORMATS = ["auto", "fp8_e4m3", "int8", "int4", "kivi4", "kivi2", "int2"]


def timed(fns: dict, rounds: int, cuda: bool) -> dict[str, float]:
    """Median milliseconds per function; rounds interleave the functions (shared machines)."""
    import torch

    if cuda:
        from triton.testing import do_bench

        return {n: do_bench(f, warmup=5, rep=40, return_mode="median") for n, f in fns.items()}
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            if cuda:
                torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(t) for n, t in times.items()}


def build(fmt: str, batch: int, ctx: int, hq, hk, d, dtype, dev, gen, backend: str):
    """A cache of ``fmt`` holding ``batch`` requests of ``ctx`` tokens, and one decode step."""
    import kvcore_kernels as kk
    import torch
    from kvcore_kernels.quant import allocate_kv_caches

    bs = 16
    per = -(-(ctx + 1) // bs)
    num_blocks = 1 + batch * per
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, per).to(torch.int32)
    step = max(bs, min(ctx, 4096 // batch if dev.type == "cpu" else 1024))  # fill in chunks
    slots_needed = batch * (step // bs + 2)  # KIVI: blocks one fill step writes, per request
    cache = allocate_kv_caches(
        fmt, 1, num_blocks, bs, hk, d, dtype, dev, num_residual_blocks=slots_needed
    )[0]
    for start in range(0, ctx, step):
        n = min(step, ctx - start)
        pos = torch.arange(start, start + n)
        slots = (table[:, pos // bs].long() * bs + pos % bs).reshape(-1).to(dev)
        kv = torch.randn(batch * n, hk, d, generator=gen).to(dtype).to(dev)
        kk.store_kv(kv, kv * 0.5, cache, slots, backend=backend)
    q = torch.randn(batch, hq, d, generator=gen).to(dtype).to(dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx + 1, dtype=torch.int32)
    meta = kk.plan_attention(qsl, lens, table, bs, device=dev)
    new_slots = (table[:, ctx // bs].long() * bs + ctx % bs).to(dev)
    new_kv = torch.randn(batch, hk, d, generator=gen).to(dtype).to(dev)
    kk.store_kv(new_kv, new_kv, cache, new_slots, backend=backend)

    def attend():
        return kk.paged_attention(q, cache, meta, scale=d**-0.5, backend=backend)

    attend.args = (q, cache, meta)  # for the twin check

    def store():
        kk.store_kv(new_kv, new_kv, cache, new_slots, backend=backend)

    return attend, store, cache


def cache_bytes(cache, batch: int, ctx: int) -> int:
    """Bytes a decode step reads from the cache (rows of the blocks it touches)."""
    from kvcore_kernels.quant import QuantKVCache

    if isinstance(cache, QuantKVCache):
        per_token = cache.layout.block_bytes / cache.block_size
    else:
        per_token = cache[0].numel() * cache.element_size() / cache.shape[2]
    return int(per_token * batch * ctx)


def copy_gbps(dev, numel: int, rounds: int, cuda: bool) -> float:
    """Device-to-device copy bandwidth (bytes read + written / time): the peer of every
    decode_bandwidth line, measured in the same run."""
    import torch

    src = torch.empty(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t = timed({"copy": lambda: dst.copy_(src)}, rounds, cuda)["copy"]
    return 2 * numel * 4 / t / 1e6


TARGET_SPEEDUP = {"fp8_e4m3": 1.7, "int8": 1.7, "int4": 2.5, "kivi4": 2.5, "kivi2": 3.0}


def run(args: argparse.Namespace) -> None:
    import torch

    cuda = args.device == "cuda"
    if cuda and not (torch.cuda.is_available() or args.dry_run):
        sys.exit("bench_quant: --device cuda needs a GPU (or --dry-run)")
    on_gpu = cuda and not args.dry_run
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if cuda:
        hq, hk, d, dtype = 32, 8, 128, torch.bfloat16
        shapes = [(1, 32768), (8, 32768)] if not args.dry_run else [(1, 40), (2, 40)]
    else:
        hq, hk, d, dtype = 9, 3, 64, torch.float32
        shapes = [(args.batch, args.context)]
    rounds = 1 if args.dry_run else args.rounds
    gen = torch.Generator().manual_seed(0)
    formats = args.formats.split(",")
    if "auto" not in formats:
        formats.insert(0, "auto")
    print(f"device: {dev} ({'triton' if cuda else 'torch twin'}), heads {hq}/{hk}, head_dim {d}")
    copy = copy_gbps(dev, 1 << 28 if on_gpu else 1 << 20, rounds, on_gpu)
    print(f"copy_bandwidth: {copy:.0f} GB/s")
    for batch, ctx in shapes:
        fns, caches, checks = {}, {}, {}
        for fmt in formats:
            backend = "triton" if cuda else "torch"
            attend, store, cache = build(fmt, batch, ctx, hq, hk, d, dtype, dev, gen, backend)
            fns[f"decode_{fmt}"], fns[f"store_{fmt}"], caches[fmt] = attend, store, cache
            if cuda and batch == shapes[0][0]:  # Triton against the torch twin, once per format
                checks[fmt] = (attend().float() - twin_decode(cache, attend)).abs().max().item()
        ms = timed(fns, rounds, on_gpu)
        tag = f"b{batch}_ctx{ctx}"
        for fmt in formats:
            t, base = ms[f"decode_{fmt}"], ms["decode_auto"]
            gbs = cache_bytes(caches[fmt], batch, ctx) / t / 1e6
            print(f"decode_ms_{fmt}_{tag}: {t:.4f} ms")
            print(f"decode_speedup_vs_auto_{fmt}_{tag}: {base / t:.3f} x")
            print(f"decode_bandwidth_{fmt}_{tag}: {gbs:.1f} GB/s")
            print(f"decode_pct_of_copy_{fmt}_{tag}: {100 * gbs / copy:.1f} %")
            print(f"store_us_{fmt}_{tag}: {1e3 * ms[f'store_{fmt}']:.1f} us")
            print(f"store_over_auto_{fmt}_{tag}: {ms[f'store_{fmt}'] / ms['store_auto']:.3f} x")
            if fmt in checks:
                print(f"check_max_abs_diff_triton_vs_twin_{fmt}_{tag}: {checks[fmt]:.5f}")
        if cuda:
            for fmt, want in TARGET_SPEEDUP.items():
                if fmt in formats:
                    got = ms["decode_auto"] / ms[f"decode_{fmt}"]
                    gbs = cache_bytes(caches[fmt], batch, ctx) / ms[f"decode_{fmt}"] / 1e6
                    ok = got >= want and gbs >= 0.8 * copy
                    print(f"target_{fmt}_{want}x_80pct_{tag}: {'met' if ok else 'MISSED'}")


def twin_decode(cache, attend):
    """The torch twin's output for the same decode step ``attend`` runs (closure's arguments)."""
    import kvcore_kernels as kk

    q, c, meta = attend.args
    return kk.paged_attention(q, c, meta, scale=q.shape[-1] ** -0.5, backend="torch").float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dry-run", action="store_true", help="CUDA path under the interpreter")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before kvcore_kernels' Triton modules load
        args.device = "cuda"
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
