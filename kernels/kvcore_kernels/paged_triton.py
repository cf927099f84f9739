"""The paged-attention Triton kernel every cache layout runs, and its one launcher.

Grid ``(num_tiles, num_kv_heads, num_splits)``. A tile is up to ``BLOCK_Q`` consecutive query
tokens of one request; its ``BLOCK_M = BLOCK_Q * QUERIES_PER_KV`` rows are those tokens times
the query heads sharing one KV head, so each K/V tile is loaded once for the whole group
(rows packed as in vLLM's unified Triton attention). Row ``m`` of a tile::

    token q_first + m // QUERIES_PER_KV,  head kv_head * QUERIES_PER_KV + m % QUERIES_PER_KV

Its keys are ``[k_start, k_end)`` (causal end of its last token, window start of its first).
With ``num_splits > 1`` (few tiles, long contexts: a decode batch of one still fills the GPU)
split ``s`` takes the ``s``-th of ``num_splits`` contiguous shares of the tile's key tiles
(``split_tiles``) and writes its unnormalised partial (acc, max, sum);
``splits_triton.merge_splits_kernel`` combines them (the flash-decoding idea of Dao et al.).

``paged_attention_kernel`` is the skeleton: the query tile (prologue), the online-softmax state,
the output or the split's partial (epilogue). The one part a cache layout does its own way, the
walk over the K/V tiles, is its ``KV_LOOP``: a ``@triton.jit`` function passed as a constexpr
(``attention_triton.plain_kv_loop``, ``quant.attention_triton.quant_kv_loop``) that gets the
layout's pointers and strides in the ``cache`` tuple and its constants in the ``CACHE`` tuple,
calls ``softmax_triton``'s ``tile_scores`` / ``online_softmax`` per tile and returns the
updated ``(acc, m_i, l_i)``. Every loop takes the arguments ``KV_LOOP_ARGS`` names.

Host side, ``plan_launch`` is the one launcher: argument limits, the tile shape
(``block_shape``), the work list, the split count (of the keys a tile can see: the sliding
window bounds it) and the partial buffers; ``PagedLaunch.run`` adds the layout's loop and
tuples, launches (autotuned on CUDA prefill if the layout asks) and merges the splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcore_kernels.checks import AttentionCall
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.schedule import (
    LOG2E,
    MAX_QUERIES_PER_KV,
    NO_WINDOW,
    SUPPORTED_HEAD_DIMS,
    work_tiles,
)
from kvcore_kernels.splits_triton import choose_num_splits, merge_splits_kernel
from kvcore_kernels.triton_util import (
    check_dense_metadata,
    check_triton_device,
    compute_dtype,
    is_interpreted,
)

# The arguments of every KV_LOOP, in the order the kernel passes them (positionally; a test
# checks each loop's signature against it).
KV_LOOP_ARGS = (
    "acc", "m_i", "l_i", "q", "q_pos", "slope", "row_ok", "req", "kv_head", "split",
    "num_splits", "ctx", "q_first", "k_start", "k_end", "table_row", "qk_scale", "soft_cap",
    "sliding_window", "num_released", "cache", "CACHE", "BLOCK_SIZE", "HEAD_DIM", "BLOCK_N",
    "USE_SOFTCAP", "USE_ALIBI", "COMPUTE_DTYPE", "DOT_PRECISION",
)  # fmt: skip


@triton.jit
def split_tiles(num_kv_tiles, split, num_splits):
    """(first, end) key tile of split ``split``: the ``split``-th of ``num_splits`` contiguous
    shares of ``num_kv_tiles`` (the last ones may be empty)."""
    per_split = tl.cdiv(num_kv_tiles, num_splits)
    t_begin = split * per_split
    return t_begin, tl.minimum(t_begin + per_split, num_kv_tiles)


@triton.jit(do_not_specialize=["sliding_window", "num_splits", "num_tokens", "num_released"])
def paged_attention_kernel(
    query_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    cache,  # tuple: the layout's cache pointers and strides (read by KV_LOOP only)
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    tile_req_ptr,  # [num_tiles] int32: request of each query tile
    tile_start_ptr,  # [num_tiles] int32: first query of the tile, counted within its request
    alibi_slopes_ptr,  # [num_q_heads] fp32 (read only if USE_ALIBI)
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM] (written unless SPLIT_KV)
    part_acc_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_DIM] fp32 (if SPLIT_KV)
    part_max_ptr,  # [num_splits, num_tokens, num_q_heads] fp32, log2 units
    part_sum_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    qk_scale,  # scale * log2(e)
    soft_cap,  # soft_cap * log2(e) (read only if USE_SOFTCAP)
    sliding_window,  # NO_WINDOW when off
    num_splits,  # grid axis 2; a runtime value, so split counts share one compiled kernel
    num_released,  # null entries in the step's block table (released blocks)
    num_tokens,
    num_q_heads,
    tune_bucket,  # unused by the body: the autotuner's key (log2 of the step's query count)
    stride_query_tok,
    stride_query_head,
    stride_table_req,
    stride_out_tok,
    stride_out_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # num_splits > 1: write partials for merge_splits_kernel
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CACHE: tl.constexpr,  # tuple: the layout's compile-time constants
    KV_LOOP: tl.constexpr,  # @triton.jit: the layout's walk over the key tiles
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    ctx = tl.load(seq_lens_ptr + req) - q_len

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_first + rows // QUERIES_PER_KV  # query index within the request
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    q_pos = ctx + q_idx  # [BLOCK_M] position in the sequence
    tok = (q_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    q = tl.load(  # [BLOCK_M, HEAD_DIM]
        query_ptr
        + tok[:, None] * stride_query_tok
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(COMPUTE_DTYPE)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
    last_q = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    k_end = ctx + last_q + 1
    k_start = tl.maximum(ctx + q_first - sliding_window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, m_i, l_i = KV_LOOP(
        acc, m_i, l_i, q, q_pos, slope, row_ok, req, kv_head, split, num_splits, ctx, q_first,
        k_start, k_end, block_table_ptr + req * stride_table_req, qk_scale, soft_cap,
        sliding_window, num_released, cache, CACHE, BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_SOFTCAP,
        USE_ALIBI, COMPUTE_DTYPE, DOT_PRECISION,
    )  # fmt: skip

    if not SPLIT_KV:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on padding rows
        tl.store(
            out_ptr
            + tok[:, None] * stride_out_tok
            + head[:, None] * stride_out_head
            + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        part = (split * num_tokens + tok) * num_q_heads + head  # [BLOCK_M] int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


# Prefill / mixed steps of a layout that asks for it: tiles and pipeline depth autotuned per
# (head dim, GQA group, BLOCK_M, step size bucket, layout) on the GPU (Hopper wants deeper K/V
# pipelines: num_stages 3-4); the interpreter and decode steps launch with fixed choices
# (block_shape).
PREFILL_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bn, w, st in (
        (64, 8, 2),
        (64, 8, 3),
        (64, 4, 3),
        (64, 8, 4),
        (128, 8, 2),
        (128, 8, 3),
        (32, 4, 4),
    )
]
_paged_attention_prefill = triton.autotune(
    PREFILL_CONFIGS,
    key=["HEAD_DIM", "QUERIES_PER_KV", "BLOCK_M", "SPLIT_KV", "tune_bucket", "KV_LOOP"],
)(paged_attention_kernel)


# Decode launches are not autotuned (a step's shapes change every step; autotuning would
# time every config on live data): warps by BLOCK_M, a fixed K/V pipeline depth. Module
# constants so that benches/tune_cuda_decode.py can try others on a GPU.
DECODE_NUM_STAGES = 2
DECODE_NUM_WARPS: int | None = None  # None: 4 for BLOCK_M <= 16, else 8


def block_shape(decode_only: bool, group: int, row_bytes: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and keys per tile, smaller for wide rows (fp32, 256).

    Decode tiles hold one token's query heads (padded to the 16 rows ``tl.dot`` needs);
    mixed and prefill steps pack several tokens per tile. ``row_bytes``: one query row
    (head_dim times the query's element size), for every cache layout.
    """
    narrow = row_bytes <= 256  # bf16/fp16 with head_dim <= 128
    block_n = 64 if narrow else (32 if row_bytes <= 512 else 16)
    if decode_only:
        return max(16, triton.next_power_of_2(group)), block_n
    return (128 if narrow else (64 if row_bytes <= 512 else 32)), block_n


@dataclass(eq=False)
class PagedLaunch:
    """One call's launch of ``paged_attention_kernel``, all but the layout's part."""

    call: AttentionCall
    meta: AttentionMetadata
    block_m: int
    block_n: int
    splits: int
    grid: tuple[int, int, int]
    args: dict  # the kernel arguments every layout shares

    def run(self, kv_loop, cache: tuple, consts: tuple, *, autotune: bool = False) -> torch.Tensor:
        """Launch with the layout's ``KV_LOOP``, ``cache`` tuple and ``CACHE`` constants, merge
        the splits; returns ``call.out``. ``autotune``: prefill and mixed steps on CUDA go
        through ``PREFILL_CONFIGS`` (the loop must accept any of their ``BLOCK_N``)."""
        out = self.call.out
        if self.grid[0] == 0:
            return out
        args = dict(self.args, cache=cache, CACHE=consts, KV_LOOP=kv_loop)
        if (
            not autotune
            or self.meta.max_q_len == 1
            or self.call.block_mass is not None  # it adds: autotuning trials would add too
            or is_interpreted(paged_attention_kernel)
        ):
            warps = DECODE_NUM_WARPS or (4 if self.block_m <= 16 else 8)
            paged_attention_kernel[self.grid](
                **args, BLOCK_N=self.block_n, num_warps=warps, num_stages=DECODE_NUM_STAGES
            )
        else:
            _paged_attention_prefill[self.grid](**args)
        if self.splits > 1:
            hq, d = out.shape[1], out.shape[2]
            merge_splits_kernel[(self.meta.num_tokens, hq)](
                out_ptr=out,
                part_acc_ptr=args["part_acc_ptr"],
                part_max_ptr=args["part_max_ptr"],
                part_sum_ptr=args["part_sum_ptr"],
                num_tokens=self.meta.num_tokens,
                num_q_heads=hq,
                num_splits=self.splits,
                stride_out_tok=out.stride(0),
                stride_out_head=out.stride(1),
                HEAD_DIM=d,
                SPLITS_PAD=triton.next_power_of_2(self.splits),
            )
        return out


def plan_launch(
    query: torch.Tensor, meta: AttentionMetadata, call: AttentionCall, *, key_slack: int = 0
) -> PagedLaunch:
    """Everything of a ``paged_attention_kernel`` launch but the layout's part.

    ``call`` comes from ``checks.check_attention_call``. ``key_slack``: keys a tile may walk
    before its window start (a layout whose tiles start on a block boundary: the block size),
    counted when splitting a windowed range. Raises ``KernelConfigError`` for head sizes or
    GQA groups the kernel is not compiled for, or tensors the Triton backend cannot run on.
    """
    check_triton_device(query, paged_attention_kernel)
    check_dense_metadata(meta)
    shape = call.shape
    hq, hk, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    group = hq // hk
    if d not in SUPPORTED_HEAD_DIMS or group > MAX_QUERIES_PER_KV:
        raise KernelConfigError(
            f"Triton paged attention supports head_dim {SUPPORTED_HEAD_DIMS} and <= "
            f"{MAX_QUERIES_PER_KV} query heads per KV head, got {d} and {group}"
        )
    block_m, block_n = block_shape(meta.max_q_len == 1, group, d * query.element_size())
    block_q = block_m // group
    tile_req, tile_start = work_tiles(meta, block_q)
    num_tiles = tile_req.shape[0]
    keys = meta.max_seq_len
    if call.sliding_window is not None:  # a tile sees its window plus its own queries
        keys = min(keys, call.sliding_window + block_q + key_slack)
    splits = choose_num_splits(num_tiles * hk, keys, query.device, block_n)
    if call.block_mass is not None:
        splits = 1  # the mass pass needs each row's final max and sum
    out = call.out
    if splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part_acc = torch.empty((splits, meta.num_tokens, hq, d), **f32)
        part_max = torch.empty((splits, meta.num_tokens, hq), **f32)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched
    alibi = call.alibi_slopes
    args = dict(
        query_ptr=query,
        block_table_ptr=meta.block_table,
        query_start_loc_ptr=meta.query_start_loc,
        seq_lens_ptr=meta.seq_lens,
        tile_req_ptr=tile_req,
        tile_start_ptr=tile_start,
        alibi_slopes_ptr=alibi if alibi is not None else meta.seq_lens,
        out_ptr=out,
        part_acc_ptr=part_acc,
        part_max_ptr=part_max,
        part_sum_ptr=part_sum,
        qk_scale=call.scale * LOG2E,
        soft_cap=(call.soft_cap or 1.0) * LOG2E,
        sliding_window=call.sliding_window if call.sliding_window is not None else NO_WINDOW,
        num_splits=splits,
        num_released=meta.num_released,
        num_tokens=meta.num_tokens,
        num_q_heads=hq,
        tune_bucket=int(meta.num_tokens).bit_length(),
        stride_query_tok=query.stride(0),
        stride_query_head=query.stride(1),
        stride_table_req=meta.block_table.stride(0),
        stride_out_tok=out.stride(0),
        stride_out_head=out.stride(1),
        BLOCK_SIZE=shape.block_size,
        HEAD_DIM=d,
        QUERIES_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        SPLIT_KV=splits > 1,
        USE_SOFTCAP=call.soft_cap is not None,
        USE_ALIBI=alibi is not None,
        COMPUTE_DTYPE=compute_dtype(query.dtype, paged_attention_kernel),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    grid = (num_tiles if meta.num_tokens else 0, hk, splits)
    return PagedLaunch(call, meta, block_m, block_n, splits, grid, args)
