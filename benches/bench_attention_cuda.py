"""GPU sweep of the Triton paged attention: decode and prefill, GQA 32/8, head_dim 128, bf16.

Decode reads every cached K/V byte once, so it is reported as achieved bandwidth over a
device-to-device copy measured in the same run (bytes read + written / time). Per shape:

    paged    shuffled blocks (what a long-running engine's pool looks like)
    ordered  the same kernel, each request's blocks consecutive in memory
    contig   the same kernel over a contiguous cache (one block per request): the cost of
             paging is paged / contig
    sdpa     torch's scaled_dot_product_attention on contiguous [B, H, L, D] K/V, for reference

Prefill (whole prompts, causal) is compute-bound: TFLOP/s against SDPA on the same tokens
(``prefill_over_sdpa_max``: the worst paged / SDPA time ratio; the autotuner picks the paged
kernel's tiles on the first call of each shape, outside the timed runs).
Run through ``bench_attention.py --device cuda`` or ``benches/device_check.sh``.
"""

from __future__ import annotations

import time

import kvcore_kernels as kk
import torch
import torch.nn.functional as F
from kvcore_kernels.splits_triton import choose_num_splits
from triton.testing import do_bench

HQ, HK, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
TARGETS = (
    "decode B>=32, L>=8K: >=80% of copy; B=1, L=32K: >=60%; paged within 10% of contig; "
    "prefill <= 1.4x SDPA"
)


def ms(fn) -> float:
    """Median milliseconds (do_bench on CUDA; a plain timer for the interpreter dry run)."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=5, rep=30, return_mode="median")


def copy_gbps(dev: torch.device, numel: int) -> float:
    src = torch.empty(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / t / 1e6


def decode_row(pool: torch.Tensor, batch: int, ctx: int, copy: float, gen) -> dict:
    dev = pool.device
    per_req = ctx // BS
    q = torch.randn(batch, HQ, D, device=dev, dtype=DTYPE)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    shuffled = (torch.randperm(pool.shape[0] - 1, generator=gen)[: batch * per_req] + 1).view(
        batch, per_req
    )
    ordered = torch.arange(1, batch * per_req + 1).view(batch, per_req)
    row = {"kind": "decode", "batch": batch, "ctx": ctx}
    bytes_read = 2 * batch * ctx * HK * D * pool.element_size()
    for name, table in (("paged", shuffled), ("ordered", ordered)):
        meta = kk.plan_attention(qsl, lens, table, BS, device=dev)
        row[name] = ms(lambda meta=meta: kk.paged_attention(q, pool, meta, scale=D**-0.5))
    # The same storage seen as a contiguous cache: block i+1 holds request i's whole context.
    contig = pool.view(-1)[: (batch + 1) * 2 * ctx * HK * D].view(batch + 1, 2, ctx, HK, D)
    meta = kk.plan_attention(qsl, lens, torch.arange(1, batch + 1).view(batch, 1), ctx, device=dev)
    row["contig"] = ms(lambda: kk.paged_attention(q, contig, meta, scale=D**-0.5))
    kv = pool.view(-1)[: 2 * batch * HK * ctx * D].view(2, batch, HK, ctx, D)
    try:
        row["sdpa"] = ms(
            lambda: F.scaled_dot_product_attention(
                q.view(batch, HQ, 1, D), kv[0], kv[1], scale=D**-0.5, enable_gqa=True
            )
        )
    except Exception:  # a torch without a GQA-capable SDPA backend: no reference
        row["sdpa"] = float("nan")
    for name in ("paged", "ordered", "contig", "sdpa"):
        row[name + "_pct"] = 100 * bytes_read / row[name] / 1e6 / copy
    return row


def prefill_row(pool: torch.Tensor, batch: int, ctx: int, gen) -> dict:
    dev = pool.device
    per_req = ctx // BS
    q = torch.randn(batch * ctx, HQ, D, device=dev, dtype=DTYPE)
    qsl = torch.arange(0, batch * ctx + 1, ctx, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    table = (torch.randperm(pool.shape[0] - 1, generator=gen)[: batch * per_req] + 1).view(
        batch, per_req
    )
    meta = kk.plan_attention(qsl, lens, table, BS, device=dev)
    row = {"kind": "prefill", "batch": batch, "ctx": ctx}
    kk.paged_attention(q, pool, meta, scale=D**-0.5)  # the autotuner's first call, untimed
    row["paged"] = ms(lambda: kk.paged_attention(q, pool, meta, scale=D**-0.5))
    kv = pool.view(-1)[: 2 * batch * HK * ctx * D].view(2, batch, HK, ctx, D)
    k, v = (x.repeat_interleave(HQ // HK, dim=1) for x in kv)  # FlashAttention needs no GQA
    qd = q.view(batch, ctx, HQ, D).transpose(1, 2)
    row["sdpa"] = ms(
        lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=D**-0.5)
    )
    flops = 4 * batch * HQ * D * ctx * (ctx + 1) / 2
    row["paged_tflops"] = flops / row["paged"] / 1e9
    row["sdpa_tflops"] = flops / row["sdpa"] / 1e9
    return row


def check_once(pool: torch.Tensor, gen) -> float:
    """Triton against the torch twin on one mixed step (max abs difference)."""
    dev = pool.device
    reqs = [(3000, 1), (0, 700), (1200, 300), (9000, 1)]
    lens = torch.tensor([c + q for c, q in reqs], dtype=torch.int32)
    qsl = torch.tensor([0] + [q for _, q in reqs], dtype=torch.int32).cumsum(0).to(torch.int32)
    need = (lens + BS - 1) // BS
    table = torch.zeros(len(reqs), int(need.max()), dtype=torch.int32)
    ids = torch.randperm(pool.shape[0] - 1, generator=gen) + 1
    start = 0
    for r, n in enumerate(need.tolist()):
        table[r, :n] = ids[start : start + n].to(torch.int32)
        start += n
    meta = kk.plan_attention(qsl, lens, table, BS, device=dev)
    q = torch.randn(int(qsl[-1]), HQ, D, device=dev, dtype=DTYPE)
    a = kk.paged_attention(q, pool, meta, scale=D**-0.5, backend="triton")
    b = kk.paged_attention(q, pool, meta, scale=D**-0.5, backend="torch")
    return (a.float() - b.float()).abs().max().item()


def sweep(quick: bool = False, dry_run: bool = False) -> None:
    """Print the decode/prefill table. ``dry_run``: tiny shapes on the CPU (TRITON_INTERPRET=1),
    to check this script end to end without a GPU; its numbers mean nothing."""
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (--dry-run checks this script on the CPU)")
    dev = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    batches = [1, 32, 256] if quick else [1, 4, 16, 32, 64, 128, 256]
    contexts = [1024, 8192, 32768] if quick else [1024, 4096, 8192, 16384, 32768]
    pre = [(1, 1024), (1, 8192), (1, 32768), (4, 8192), (16, 4096), (64, 1024)]
    if dry_run:
        batches, contexts, pre = [1, 32], [64, 8192], [(1, 64), (2, 32)]
    # One pool for every shape, one request's worth larger for the contiguous view.
    tokens = max(batches) * max(contexts) + max(contexts)
    pool = torch.randn(tokens // BS + 1, 2, BS, HK, D, device=dev, dtype=DTYPE)
    name = "cpu (dry run)" if dry_run else torch.cuda.get_device_name(dev)
    print(f"device: {name}; pool {pool.numel() * 2 / 2**30:.1f} GiB")
    if not dry_run:
        print(f"check_max_abs_diff_triton_vs_twin: {check_once(pool, gen):.5f}")
    copy = copy_gbps(dev, 1 << 20 if dry_run else 1 << 30)
    print(f"copy_bandwidth: {copy:.0f} GB/s")
    rows = []
    for batch in batches:
        for ctx in contexts:
            rows.append(decode_row(pool, batch, ctx, copy, gen))
            r = rows[-1]
            print(
                f"decode b={batch} ctx={ctx}: paged {r['paged']:.3f} ms "
                f"{r['paged_pct']:.0f}% of copy",
                flush=True,
            )
    for batch, ctx in pre[:3] if quick else pre:
        rows.append(prefill_row(pool, batch, ctx, gen))
    print()
    print(f"targets: {TARGETS}")
    print(
        "| kind | batch | ctx | paged ms | paged % copy | ordered % | contig % | sdpa % "
        "| paged/contig |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["kind"] == "decode":
            print(
                f"| decode | {r['batch']} | {r['ctx']} | {r['paged']:.3f} | "
                f"{r['paged_pct']:.0f} | {r['ordered_pct']:.0f} | {r['contig_pct']:.0f} | "
                f"{r['sdpa_pct']:.0f} | {r['paged'] / r['contig']:.2f} |"
            )
    print()
    print("| kind | batch | ctx | paged ms | paged TFLOP/s | sdpa ms | sdpa TFLOP/s | paged/sdpa |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["kind"] == "prefill":
            print(
                f"| prefill | {r['batch']} | {r['ctx']} | {r['paged']:.3f} | "
                f"{r['paged_tflops']:.0f} | {r['sdpa']:.3f} | {r['sdpa_tflops']:.0f} | "
                f"{r['paged'] / r['sdpa']:.2f} |"
            )
    dec = [r for r in rows if r["kind"] == "decode"]
    big = [r["paged_pct"] for r in dec if r["batch"] >= 32 and r["ctx"] >= 8192]
    one = [r["paged_pct"] for r in dec if r["batch"] == 1 and r["ctx"] == max(contexts)]
    print(f"decode_b32plus_ctx8kplus_min_pct_of_copy: {min(big, default=float('nan')):.1f} %")
    print(f"decode_b1_ctx{max(contexts) // 1024}k_pct_of_copy: {one[0]:.1f} %")
    print(f"decode_paged_over_contig_max: {max(r['paged'] / r['contig'] for r in dec):.3f} x")
    pre_rows = [r for r in rows if r["kind"] == "prefill"]
    worst = max(r["paged"] / r["sdpa"] for r in pre_rows)
    print(f"prefill_over_sdpa_max: {worst:.3f} x  (target <= 1.4)")
    print(f"prefill_paged_tflops_min: {min(r['paged_tflops'] for r in pre_rows):.1f} TFLOP/s")
    splits = choose_num_splits(HK, max(contexts), dev)
    print(f"decode_b1_num_kv_splits: {splits}  (grid {HK * splits} programs)")
