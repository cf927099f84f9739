"""Triton KIVI block encoder: whole blocks from the residual (or a step's K/V) into block rows.

One program per (block, KV head): keys are quantized per channel over the block's valid rows
(fp16 minimum, e5m3 scale code rounded up), values per token over the head dim (fp16 scale and
minimum), codes packed along the head dim, exactly as ``codecs.kivi_encode_blocks``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.encode_triton import pack_rows, scale_code
from kvcore_kernels.quant.formats import region_offsets
from kvcore_kernels.triton_util import check_triton_device


@triton.jit
def _encode_blocks_kernel(
    src_ptr,  # [N, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM] model dtype
    src_index_ptr,  # [n] int64: source block of each job
    dst_block_ptr,  # [n] int64: destination block row
    fill_ptr,  # [n] int64: valid rows (read if HAS_FILL)
    buf_ptr,  # uint8 [num_blocks, NUM_KV_HEADS * HEAD_BYTES]
    stride_src_n,
    stride_src_kv,
    stride_src_pos,
    stride_src_head,
    BLOCK_SIZE: tl.constexpr,
    BS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_BYTES: tl.constexpr,  # one head segment of a block row (formats docstring)
    BITS: tl.constexpr,
    HAS_FILL: tl.constexpr,
    DATA_OFF: tl.constexpr,
    KMIN_OFF: tl.constexpr,
    KCODE_OFF: tl.constexpr,
    VSCALE_OFF: tl.constexpr,
    VMIN_OFF: tl.constexpr,
):
    job = tl.program_id(0)
    head = tl.program_id(1)
    src = tl.load(src_index_ptr + job)
    dst = tl.load(dst_block_ptr + job)
    fill = tl.load(fill_ptr + job) if HAS_FILL else BLOCK_SIZE
    rows = tl.arange(0, BS_PAD)  # [BS_PAD] positions in the block
    dims = tl.arange(0, HEAD_DIM)
    levels: tl.constexpr = (1 << BITS) - 1
    width: tl.constexpr = HEAD_DIM * BITS // 8
    row_ok = rows < BLOCK_SIZE
    base = src_ptr + src * stride_src_n + head * stride_src_head
    offs = rows[:, None] * stride_src_pos + dims[None, :]  # [BS_PAD, HEAD_DIM]
    k = tl.load(base + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(base + stride_src_kv + offs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    seg = buf_ptr + dst * (NUM_KV_HEADS * HEAD_BYTES) + head * HEAD_BYTES  # this head's bytes
    cols = tl.arange(0, width)

    # Keys: per channel over the block's valid rows; fp16 min, e5m3 scale code rounded up.
    valid = (rows < fill)[:, None]
    lo = tl.min(tl.where(valid, k, float("inf")), 0)  # [HEAD_DIM]
    hi = tl.max(tl.where(valid, k, float("-inf")), 0)
    lo = tl.where(lo == float("inf"), 0.0, lo)
    hi = tl.where(hi == float("-inf"), 0.0, hi)
    kmin16 = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16)
    kmin = kmin16.to(tl.float32)
    code, ks = scale_code((hi - kmin) / levels)
    qk = tl.floor((k - kmin[None, :]) / ks[None, :] + 0.5)
    qk = tl.minimum(tl.maximum(qk, 0.0), levels).to(tl.int32)
    tl.store(  # K codes: rows 0..bs-1 of the segment's [2, bs, width] data
        seg + DATA_OFF + rows[:, None] * width + cols[None, :],
        pack_rows(qk, BS_PAD, HEAD_DIM, BITS),
        mask=row_ok[:, None],
    )
    tl.store((seg + KMIN_OFF).to(tl.pointer_type(tl.float16)) + dims, kmin16)
    tl.store(seg + KCODE_OFF + dims, code)

    # Values: per token over the head dim; fp16 scale and min.
    vlo = tl.minimum(tl.maximum(tl.min(v, 1), -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    vs16 = tl.minimum(tl.maximum((tl.max(v, 1) - vlo) / levels, 6.103515625e-05), 65504.0)
    vs16 = vs16.to(tl.float16)
    qv = tl.floor((v - vlo[:, None]) / vs16.to(tl.float32)[:, None] + 0.5)
    qv = tl.minimum(tl.maximum(qv, 0.0), levels).to(tl.int32)
    tl.store(
        seg + DATA_OFF + (BLOCK_SIZE + rows)[:, None] * width + cols[None, :],
        pack_rows(qv, BS_PAD, HEAD_DIM, BITS),
        mask=row_ok[:, None],
    )
    tl.store((seg + VSCALE_OFF).to(tl.pointer_type(tl.float16)) + rows, vs16, mask=row_ok)
    vmin_ptr = (seg + VMIN_OFF).to(tl.pointer_type(tl.float16))
    tl.store(vmin_ptr + rows, vlo.to(tl.float16), mask=row_ok)


def encode_blocks_triton(
    cache: QuantKVCache,
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst_blocks: torch.Tensor,
    fills: torch.Tensor | None,
) -> None:
    """Triton KIVI block encoder: ``src[src_index]`` ``[n, 2, bs, H, D]`` into ``dst_blocks``."""
    check_triton_device(cache.buffer, _encode_blocks_kernel)
    n = dst_blocks.numel()
    if n == 0:
        return
    data_off, kmin_off, kcode_off, vscale_off, vmin_off = region_offsets(cache.layout)
    _encode_blocks_kernel[(n, cache.num_kv_heads)](
        src_ptr=src,
        src_index_ptr=src_index,
        dst_block_ptr=dst_blocks,
        fill_ptr=fills if fills is not None else dst_blocks,
        buf_ptr=cache.buffer,
        stride_src_n=src.stride(0),
        stride_src_kv=src.stride(1),
        stride_src_pos=src.stride(2),
        stride_src_head=src.stride(3),
        BLOCK_SIZE=cache.block_size,
        BS_PAD=triton.next_power_of_2(cache.block_size),
        NUM_KV_HEADS=cache.num_kv_heads,
        HEAD_DIM=cache.head_dim,
        HEAD_BYTES=cache.layout.head_bytes,
        BITS=cache.fmt.bits,
        HAS_FILL=fills is not None,
        DATA_OFF=data_off,
        KMIN_OFF=kmin_off,
        KCODE_OFF=kcode_off,
        VSCALE_OFF=vscale_off,
        VMIN_OFF=vmin_off,
    )
