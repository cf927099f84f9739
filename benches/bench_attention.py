"""Paged attention benchmark: ``name: value unit`` lines, each with its peer from the same run.

``--device cpu`` (default): the torch twin's decode step for 64 requests x 1,024 tokens, GQA 9/3,
head_dim 64, fp32 (SmolLM2's shape), against ``scaled_dot_product_attention`` on the same
tokens laid out contiguously ([B, H, L, D], the best of GQA-native and pre-expanded K/V).
Rounds interleave twin and peer; medians are reported, and minima (an idle machine's view).
The native CPU kernel (backend "cpu") runs in the same rounds: ``cpu_kernel_ratio_vs_sdpa``
(kernel over the same SDPA peer), ``cpu_kernel_pct_of_copy`` (a ``copy_`` of the K/V bytes it
reads, in the same rounds). The issue-25 target: ``--dtype bf16 --batch 32 --seed S``.
``--sweep`` (``bench_attention_cpu.py``): decode batch 1-64 x 512-16K, prefill 512-4K, int8 /
fp8 against bf16; ``--quick`` shrinks it to a CI-sized run.

``--device cuda``: the bandwidth table of ``bench_attention_cuda.py`` (decode and prefill
sweep, % of a device-to-device copy measured in the same run).

Needs only ``kvcore_kernels`` (pure Python) on the path, not the kvcore extension.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import kvcore_kernels as kk
import torch
import torch.nn.functional as F


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int
) -> dict[str, tuple[float, float]]:
    """(median, min) milliseconds of each function over rounds interleaved so that load from
    other processes hits all alike (the min approximates an idle machine)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def paged_copy(
    gen: torch.Generator, keys: torch.Tensor, values: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter contiguous [B, Hk, L, D] K/V into a cache with shuffled blocks; the block table."""
    batch, num_kv_heads, length, head_dim = keys.shape
    per_req = -(-length // block_size)
    num_blocks = 1 + batch * per_req
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, per_req)
    cache = kk.allocate_kv_cache(
        num_blocks, block_size, num_kv_heads, head_dim, keys.dtype, keys.device
    )
    pos = torch.arange(length)
    for half, src in ((0, keys), (1, values)):
        cache[:, half].index_put_(
            (table[:, pos // block_size], (pos % block_size).expand(batch, -1)),
            src.transpose(1, 2),
        )
    return cache, table.to(torch.int32)


def bench_cpu(args: argparse.Namespace) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    batch, hq, hk, d, length, bs = args.batch, 9, 3, 64, args.context, args.block_size
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    q = torch.randn(batch, hq, d, generator=gen).to(dtype)
    keys = torch.randn(batch, hk, length, d, generator=gen).to(dtype)
    values = torch.randn(batch, hk, length, d, generator=gen).to(dtype)
    keys_x = keys.repeat_interleave(hq // hk, dim=1)
    values_x = values.repeat_interleave(hq // hk, dim=1)
    cache, table = paged_copy(gen, keys, values, bs)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), length, dtype=torch.int32)
    scale = d**-0.5
    meta = kk.plan_attention(qsl, lens, table, bs)
    q4 = q.view(batch, hq, 1, d)

    def twin():
        return kk.paged_attention(q, cache, meta, scale=scale, backend="torch")

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q4, keys, values, scale=scale, enable_gqa=True)

    def sdpa_expanded():
        return F.scaled_dot_product_attention(q4, keys_x, values_x, scale=scale)

    def kernel():
        return kk.paged_attention(q, cache, meta, scale=scale, backend="cpu")

    dst = torch.empty_like(keys), torch.empty_like(values)

    def copy():  # the bytes the kernel reads, copied: the bandwidth yardstick
        dst[0].copy_(keys)
        dst[1].copy_(values)

    def step_overhead() -> float:
        """Per step, once: plan + the twin's chunk layout (first layer minus a later layer)."""
        t0 = time.perf_counter()
        m = kk.plan_attention(qsl, lens, table, bs)
        kk.paged_attention(q, cache, m, scale=scale, backend="torch")
        t1 = time.perf_counter()
        kk.paged_attention(q, cache, m, scale=scale, backend="torch")
        return (2 * t1 - t0 - time.perf_counter()) * 1e3

    err = (twin().float() - sdpa_gqa().view(batch, hq, d).float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"twin disagrees with SDPA: {err}"
    err = (kernel().float() - sdpa_gqa().view(batch, hq, d).float()).abs().max().item()
    assert err < (1e-4 if dtype == torch.float32 else 3e-2), f"kernel disagrees with SDPA: {err}"

    # A ragged batch (lengths spread +-25% around the same mean) and a mixed step with a
    # 256-token prefill chunk: the twin on the shapes an engine step really has.
    ragged = torch.randint(length * 3 // 4, length * 5 // 4 + 1, (batch,), generator=gen)
    ragged = ragged.to(torch.int32)
    rmeta = kk.plan_attention(qsl, ragged, _table_for(ragged, bs, cache.shape[0], gen), bs)
    rq = torch.randn(batch, hq, d, generator=gen).to(dtype)
    mixed_lens = torch.cat([lens, torch.tensor([length], dtype=torch.int32)])
    mixed_qsl = torch.cat([qsl, torch.tensor([batch + 256], dtype=torch.int32)])
    mixed_table = torch.cat([table, table[:1]])
    mmeta = kk.plan_attention(mixed_qsl, mixed_lens, mixed_table, bs)
    mq = torch.randn(batch + 256, hq, d, generator=gen).to(dtype)

    ms = interleaved(
        {
            "twin": twin,
            "sdpa_gqa": sdpa_gqa,
            "sdpa_expanded": sdpa_expanded,
            "twin_ragged": lambda: kk.paged_attention(
                rq, cache, rmeta, scale=scale, backend="torch"
            ),
            "twin_mixed": lambda: kk.paged_attention(
                mq, cache, mmeta, scale=scale, backend="torch"
            ),
            "kernel": kernel,
            "copy": copy,
        },
        args.rounds,
    )
    best = {name: v[1] for name, v in ms.items()}
    ms = {name: v[0] for name, v in ms.items()}
    ms["step_overhead"] = statistics.median(
        step_overhead() for _ in range(max(3, args.rounds // 3))
    )
    peer = min(ms["sdpa_gqa"], ms["sdpa_expanded"])
    kv_bytes = 2 * keys.numel() * keys.element_size()
    print(
        f"shape: decode {batch} requests x {length} tokens, heads {hq}/{hk}, head_dim {d}, "
        f"{args.dtype}, block_size {bs}, threads {torch.get_num_threads()}"
    )
    print(f"twin_ms: {ms['twin']:.3f} ms")
    print(f"sdpa_ms: {peer:.3f} ms")
    print(f"ratio_vs_sdpa: {ms['twin'] / peer:.3f} x")
    print(f"sdpa_gqa_ms: {ms['sdpa_gqa']:.3f} ms")
    print(f"sdpa_expanded_ms: {ms['sdpa_expanded']:.3f} ms")
    peer_min = min(best["sdpa_gqa"], best["sdpa_expanded"])
    print(f"twin_min_ms: {best['twin']:.3f} ms")
    print(f"sdpa_min_ms: {peer_min:.3f} ms")
    print(f"ratio_vs_sdpa_min: {best['twin'] / peer_min:.3f} x")
    print(f"twin_bandwidth: {kv_bytes / ms['twin'] / 1e6:.2f} GB/s")
    print(f"twin_ragged_ms: {ms['twin_ragged']:.3f} ms")
    print(f"twin_mixed_ms: {ms['twin_mixed']:.3f} ms  (plus one 256-token prefill chunk)")
    print(f"plan_ms: {ms['step_overhead']:.3f} ms  (once per step: plan + chunk layout)")
    print(f"cpu_kernel_ms: {ms['kernel']:.3f} ms")
    print(f"cpu_kernel_ratio_vs_sdpa: {ms['kernel'] / peer:.3f} x")
    print(f"cpu_kernel_ratio_vs_sdpa_min: {best['kernel'] / peer_min:.3f} x")
    print(f"cpu_kernel_ratio_vs_twin: {ms['kernel'] / ms['twin']:.3f} x")
    print(f"cpu_kernel_bandwidth: {kv_bytes / ms['kernel'] / 1e6:.2f} GB/s")
    print(f"copy_bandwidth: {kv_bytes / ms['copy'] / 1e6:.2f} GB/s")
    print(f"cpu_kernel_pct_of_copy: {100 * ms['copy'] / ms['kernel']:.1f} %")


def _table_for(lens: torch.Tensor, bs: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Shuffled block table for ``lens`` over an existing pool of ``num_blocks``."""
    need = (lens + bs - 1) // bs
    table = torch.zeros(len(lens), int(need.max()), dtype=torch.int32)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    used = 0
    for r, n in enumerate(need.tolist()):  # setup only, not timed
        if used + n > len(ids):
            ids = torch.randperm(num_blocks - 1, generator=gen) + 1
            used = 0
        table[r, :n] = ids[used : used + n].to(torch.int32)
        used += n
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="a smaller sweep (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="cpu: torch threads (0: default)")
    parser.add_argument("--sweep", action="store_true", help="cpu: the native kernel's sweep")
    parser.add_argument("--budget", type=float, default=1.5, help="cpu sweep: seconds per row")
    parser.add_argument(
        "--dry-run", action="store_true", help="cuda: tiny shapes on the CPU (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        from bench_attention_cuda import sweep

        sweep(quick=args.quick, dry_run=args.dry_run)
    elif args.sweep:
        from bench_attention_cpu import sweep

        sweep(quick=args.quick, dtype_name=args.dtype, seed=args.seed, budget_s=args.budget)
    else:
        bench_cpu(args)


if __name__ == "__main__":
    main()
