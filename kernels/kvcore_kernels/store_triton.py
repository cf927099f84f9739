"""Triton cache write: one program per token copies its K and V rows into their slot.

Slots in the null block, negative slots (padding) and slots past the cache's end are skipped
inside the kernel (a range check on the host would cost a device sync per step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.checks import check_store_args
from kvcore_kernels.triton_util import check_triton_device


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int32 or int64
    num_slots,  # num_blocks * block_size
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    dims = tl.arange(0, DIM_PAD)  # [DIM_PAD]
    # The slot is broadcast to the tile before comparing: the interpreter rejects a mask made
    # of a scalar bool and a block.
    slots = tl.zeros([HEADS_PAD, DIM_PAD], dtype=tl.int64) + slot  # [HEADS_PAD, DIM_PAD]
    mask = (slots >= BLOCK_SIZE) & (slots < num_slots)
    mask = mask & (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    key = tl.load(  # [HEADS_PAD, DIM_PAD]
        key_ptr + tok * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(  # [HEADS_PAD, DIM_PAD]
        value_ptr + tok * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    dst = (  # [HEADS_PAD, DIM_PAD] pointers into the K half of the slot
        kv_cache_ptr
        + block * stride_cache_block
        + offset * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(dst, key, mask=mask)
    tl.store(dst + stride_cache_kv, value, mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton ``store_kv``: same contract as ``store_kv_torch``; skips out-of-range slots."""
    num_blocks, block_size, num_kv_heads, head_dim = check_store_args(
        key, value, kv_cache, slot_mapping
    )
    check_triton_device(kv_cache, _store_kv_kernel)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        kv_cache_ptr=kv_cache,
        slot_mapping_ptr=slot_mapping,
        num_slots=num_blocks * block_size,
        stride_key_tok=key.stride(0),
        stride_key_head=key.stride(1),
        stride_value_tok=value.stride(0),
        stride_value_head=value.stride(1),
        stride_cache_block=kv_cache.stride(0),
        stride_cache_kv=kv_cache.stride(1),
        stride_cache_slot=kv_cache.stride(2),
        stride_cache_head=kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
