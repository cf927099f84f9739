"""Cache write: put a step's new K and V (packed tokens) into their slots, in place.

``slot_mapping[t]`` is the slot of token ``t``; slots in the null block (``slot < block_size``)
and negative slots (padding) are skipped. Two tokens with one slot: one of them wins.
"""

from __future__ import annotations

import torch

from kvcore_kernels.cache import check_backend, check_kv_cache
from kvcore_kernels.errors import KernelConfigError


def check_store_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[int, int, int, int]:
    """Checks both backends share; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise KernelConfigError(f"{name} must be a torch.Tensor")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise KernelConfigError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise KernelConfigError(f"{name} dtype {t.dtype} != kv_cache dtype {kv_cache.dtype}")
        if t.device != kv_cache.device:
            raise KernelConfigError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
        if t.stride(-1) != 1:
            raise KernelConfigError(f"{name} must have a unit-stride last dimension")
    if key.shape[0] != value.shape[0]:
        raise KernelConfigError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise KernelConfigError("slot_mapping must be an int32 or int64 tensor")
    if slot_mapping.shape != (key.shape[0],):
        raise KernelConfigError(
            f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != kv_cache.device:
        raise KernelConfigError(f"slot_mapping is on {slot_mapping.device}, kv_cache elsewhere")
    return num_blocks, block_size, num_kv_heads, head_dim


def store_kv_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Pure-torch twin of ``store_kv_triton``; raises on a slot past the cache's end."""
    num_blocks, block_size, _, _ = check_store_args(key, value, kv_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise KernelConfigError(
            f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots"
        )
    keep = torch.nonzero(slots >= block_size).squeeze(1)  # [num_kept]
    if keep.numel() == 0:
        return
    slots = slots[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    kv_cache[:, 0].index_put_((blocks, offsets), key.index_select(0, keep))
    kv_cache[:, 1].index_put_((blocks, offsets), value.index_select(0, keep))


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
    meta: object = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into ``kv_cache`` in place.

    ``backend``: "auto" (Triton on CUDA, the torch twin otherwise), "triton" or "torch".
    A ``kvcore_kernels.quant.QuantKVCache`` is quantized on write (``store_kv_quant``; ``meta``,
    the step's ``AttentionMetadata``, is needed only by KIVI with a residual window).
    """
    if not isinstance(kv_cache, torch.Tensor):
        from kvcore_kernels.quant import QuantKVCache, store_kv_quant

        if isinstance(kv_cache, QuantKVCache):
            store_kv_quant(key, value, kv_cache, slot_mapping, meta=meta, backend=backend)
            return
    check_kv_cache(kv_cache)
    if check_backend(backend, kv_cache.device) == "triton":
        from kvcore_kernels.store_triton import store_kv_triton

        store_kv_triton(key, value, kv_cache, slot_mapping)
    else:
        store_kv_torch(key, value, kv_cache, slot_mapping)
