"""CPU sweep of the native paged-attention kernel (``bench_attention.py --device cpu --sweep``).

Per shape, interleaved in one run: the native kernel (backend "cpu", K/V read in place through
a shuffled block table), the torch twin (backend "torch"; skipped past ``TWIN_MAX_TOKENS``
cached tokens, it gathers them all), SDPA over the same K/V already contiguous (GQA-native; the
peer the targets name) and a plain copy of the K/V bytes the kernel reads (``copy_``, the
bandwidth yardstick: ``pct_of_copy`` = copy time / kernel time, the two timed again as a pair,
cold, so that both read the same cache state; the interleaved figure is printed beside it); for
decode also a copy of the
same blocks out of the cache in the table's shuffled order (``gather``: whether reading scattered
blocks, rather than the kernel, is what falls short of the copy). Decode (one query per request)
over batch x context, prefill (one request, causal), and decode over int8 / fp8 caches against
bf16 at the same shape, warm (the same call repeated: at 8 x 4K and 1 x 16K the bytes stay in
L3) and cold (a 64 MB copy before every timed call, as in a forward, where each layer's K/V is
read once a step). Medians over rounds; ``--seed`` draws other data and block tables.

Clock: with one thread, the calling thread's CPU time (``time.thread_time``: every timed op
runs on that thread, and a machine shared with other jobs does not charge their time slices to
us); with more threads, wall time (``perf_counter``).
"""

from __future__ import annotations

import statistics
import time

import kvcore_kernels as kk
import torch
import torch.nn.functional as F
from kvcore_kernels.cpu_native import features
from kvcore_kernels.quant import allocate_kv_caches

HQ, HK, D, BS = 9, 3, 64, 16  # SmolLM2's attention shape
TWIN_MAX_TOKENS = 64 * 1024
FULL = {
    "decode": [(b, c) for b in (1, 8, 32, 64) for c in (512, 1024, 4096, 16384)],
    "prefill": [512, 1024, 2048, 4096],
    "quant": [(8, 4096), (1, 16384), (8, 16384)],
}
QUICK = {"decode": [(1, 512), (32, 1024)], "prefill": [512], "quant": [(2, 4096)]}


def _time(fns: dict, budget_s: float, max_rounds: int, cold: bool = False) -> dict[str, float]:
    """Median ms of each function, rounds interleaved, about ``budget_s`` in all; ``cold``: a
    64 MB copy (untimed) before every call, so that no cache holds the call's bytes."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    src = torch.empty(16 << 20) if cold else None
    dst = torch.empty_like(src) if cold else None

    def flush():
        if cold:
            dst.copy_(src)

    t0 = time.perf_counter()
    for fn in fns.values():
        flush()
        fn()
    first = time.perf_counter() - t0
    rounds = max(3, min(max_rounds, int(budget_s / max(first, 1e-6))))
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            flush()
            t = clock()
            fn()
            times[n].append((clock() - t) * 1e3)
    return {n: statistics.median(ts) for n, ts in times.items()}


def _paged(gen, batch: int, length: int, dtype):
    """Contiguous K/V [B, Hk, L, D], the same tokens in a cache with shuffled blocks, metadata."""
    from bench_attention import paged_copy

    keys = torch.randn(batch, HK, length, D, generator=gen).to(dtype)
    values = torch.randn(batch, HK, length, D, generator=gen).to(dtype)
    cache, table = paged_copy(gen, keys, values, BS)
    return keys, values, cache, table


def decode_row(gen, batch: int, length: int, dtype, budget_s: float) -> dict[str, float]:
    keys, values, cache, table = _paged(gen, batch, length, dtype)
    q = torch.randn(batch, HQ, D, generator=gen).to(dtype)
    meta = kk.plan_attention(
        torch.arange(batch + 1, dtype=torch.int32),
        torch.full((batch,), length, dtype=torch.int32),
        table,
        BS,
    )
    q4 = q.view(batch, HQ, 1, D)
    dst_k, dst_v = torch.empty_like(keys), torch.empty_like(values)
    # The same blocks copied out in the table's (shuffled) order: what reading the scattered
    # 12 KiB blocks costs a plain copy loop (``index_select``: one memcpy per block).
    blocks = table.flatten().long()
    gathered = torch.empty((len(blocks),) + tuple(cache.shape[1:]), dtype=cache.dtype)
    fns = {
        "kernel": lambda: kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu"),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q4, keys, values, scale=D**-0.5, enable_gqa=True
        ),
        "copy": lambda: (dst_k.copy_(keys), dst_v.copy_(values)),
        "gather": lambda: torch.index_select(cache, 0, blocks, out=gathered),
    }
    if batch * length <= TWIN_MAX_TOKENS:
        fns["twin"] = lambda: kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="torch")
    err = (fns["kernel"]().float() - fns["sdpa"]().view(batch, HQ, D).float()).abs().max()
    assert err < 3e-2, f"kernel disagrees with SDPA: {err}"
    ms = _time(fns, budget_s, 30)
    ms["gb_s"] = 2 * keys.numel() * keys.element_size() / ms["kernel"] / 1e6
    # The bandwidth yardstick, timed as a pair under the same cache state: cold (a 64 MB copy
    # before each call, as a forward reads each layer's K/V once a step). In the round above
    # the copy runs right after SDPA has read the same contiguous bytes, the kernel after the
    # twin's gather has evicted them: at 1 x 16K (12 MiB, L3-sized) that read the kernel's
    # share 20-40 points low.
    pair = _time({n: fns[n] for n in ("kernel", "copy")}, budget_s, 30, cold=True)
    ms["kernel_cold"], ms["copy_cold"] = pair["kernel"], pair["copy"]
    return ms


def prefill_row(gen, length: int, dtype, budget_s: float) -> dict[str, float]:
    keys, values, cache, table = _paged(gen, 1, length, dtype)
    q = torch.randn(length, HQ, D, generator=gen).to(dtype)
    meta = kk.plan_attention(
        torch.tensor([0, length], dtype=torch.int32),
        torch.tensor([length], dtype=torch.int32),
        table,
        BS,
    )
    q4 = q.transpose(0, 1)[None]
    fns = {
        "kernel": lambda: kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu"),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q4, keys, values, scale=D**-0.5, is_causal=True, enable_gqa=True
        ),
        "twin": lambda: kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="torch"),
    }
    return _time(fns, budget_s, 10)


def quant_row(gen, batch: int, length: int, budget_s: float) -> tuple[dict, dict]:
    """Decode over bf16, int8 and fp8 caches holding the same tokens (kernel only): (warm, cold)."""
    keys, values, cache, table = _paged(gen, batch, length, torch.bfloat16)
    q = torch.randn(batch, HQ, D, generator=gen).to(torch.bfloat16)
    meta = kk.plan_attention(
        torch.arange(batch + 1, dtype=torch.int32),
        torch.full((batch,), length, dtype=torch.int32),
        table,
        BS,
    )
    pos = torch.arange(length)
    slots = (table.long()[:, pos // BS] * BS + pos % BS).reshape(-1)
    k_tok = keys.permute(0, 2, 1, 3).reshape(-1, HK, D)
    v_tok = values.permute(0, 2, 1, 3).reshape(-1, HK, D)
    fns = {"bf16": lambda: kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu")}
    for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
        qc = allocate_kv_caches(fmt, 1, cache.shape[0], BS, HK, D, torch.bfloat16, "cpu")[0]
        kk.store_kv(k_tok, v_tok, qc, slots, backend="torch")
        fns[fmt] = lambda qc=qc: kk.paged_attention(q, qc, meta, scale=D**-0.5, backend="cpu")
    return _time(fns, budget_s, 30), _time(fns, budget_s, 30, cold=True)


def sweep(quick: bool, dtype_name: str, seed: int, budget_s: float) -> None:
    """Print the three tables (markdown) and ``name: value`` summary lines."""
    grid = QUICK if quick else FULL
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    print(f"# CPU sweep: heads {HQ}/{HK}, head_dim {D}, block {BS}, {dtype_name}, seed {seed}, "
          f"threads {torch.get_num_threads()}, features {features()}, clock "
          f"{'thread CPU time' if torch.get_num_threads() == 1 else 'wall'}")  # fmt: skip
    print("\n| decode batch x ctx | kernel ms | twin ms | SDPA ms | kernel/SDPA | kernel GB/s "
          "| copy ms | % of copy, interleaved | kernel / copy ms, cold pair | % of copy, cold "
          "| gather ms | gather % of copy |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for batch, length in grid["decode"]:
        ms = decode_row(gen, batch, length, dtype, budget_s)
        twin = f"{ms['twin']:.2f}" if "twin" in ms else "-"
        print(f"| {batch} x {length} | {ms['kernel']:.3f} | {twin} | {ms['sdpa']:.2f} | "
              f"{ms['kernel'] / ms['sdpa']:.3f} | {ms['gb_s']:.1f} | {ms['copy']:.3f} | "
              f"{100 * ms['copy'] / ms['kernel']:.0f}% | {ms['kernel_cold']:.3f} / "
              f"{ms['copy_cold']:.3f} | {100 * ms['copy_cold'] / ms['kernel_cold']:.0f}% | "
              f"{ms['gather']:.3f} | {100 * ms['copy'] / ms['gather']:.0f}% |")  # fmt: skip
        tag = f"b{batch}_ctx{length}"
        print(f"decode_pct_of_copy_{tag}: {100 * ms['copy_cold'] / ms['kernel_cold']:.1f} %")
        print(f"decode_pct_of_copy_interleaved_{tag}: {100 * ms['copy'] / ms['kernel']:.1f} %")
        print(f"decode_gather_pct_of_copy_{tag}: {100 * ms['copy'] / ms['gather']:.1f} %")
        print(f"decode_kernel_ratio_vs_sdpa_{tag}: {ms['kernel'] / ms['sdpa']:.3f} x")
    print("\n| prefill tokens | kernel ms | twin ms | SDPA ms (causal) | kernel/SDPA |\n"
          "|---|---|---|---|---|")  # fmt: skip
    worst = 0.0
    for length in grid["prefill"]:
        ms = prefill_row(gen, length, dtype, budget_s)
        worst = max(worst, ms["kernel"] / ms["sdpa"])
        print(f"| {length} | {ms['kernel']:.2f} | {ms['twin']:.2f} | {ms['sdpa']:.2f} | "
              f"{ms['kernel'] / ms['sdpa']:.3f} |")  # fmt: skip
    print(f"prefill_kernel_over_sdpa_max: {worst:.3f} x")
    print("\n| quantized decode batch x ctx | bf16 ms | int8 ms | fp8_e4m3 ms | fp8_e5m2 ms |\n"
          "|---|---|---|---|---|")  # fmt: skip
    cold = {}
    for batch, length in grid["quant"]:
        ms, cold[batch, length] = quant_row(gen, batch, length, budget_s)
        print(f"| {batch} x {length} | {ms['bf16']:.3f} | {ms['int8']:.3f} | "
              f"{ms['fp8_e4m3']:.3f} | {ms['fp8_e5m2']:.3f} |")  # fmt: skip
        for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
            print(f"quant_speedup_vs_bf16_{fmt}_b{batch}_ctx{length}: "
                  f"{ms['bf16'] / ms[fmt]:.3f} x")  # fmt: skip
    print("\n| quantized decode, cold, batch x ctx | bf16 ms | int8 ms | fp8_e4m3 ms "
          "| fp8_e5m2 ms |\n|---|---|---|---|---|")  # fmt: skip
    for (batch, length), ms in cold.items():
        print(f"| {batch} x {length} | {ms['bf16']:.3f} | {ms['int8']:.3f} | "
              f"{ms['fp8_e4m3']:.3f} | {ms['fp8_e5m2']:.3f} |")  # fmt: skip
        for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
            print(f"quant_cold_speedup_vs_bf16_{fmt}_b{batch}_ctx{length}: "
                  f"{ms['bf16'] / ms[fmt]:.3f} x")  # fmt: skip
