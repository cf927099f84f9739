"""Argument checks the quantized-cache backends share (bottom layer: no kernel imports)."""

from __future__ import annotations

import torch

from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant.cache import QuantKVCache


def check_quant_store_args(
    key: torch.Tensor, value: torch.Tensor, cache: QuantKVCache, slot_mapping: torch.Tensor
) -> None:
    """Checks shared by both backends; raises ``KernelConfigError``."""
    if not isinstance(cache, QuantKVCache):
        raise KernelConfigError("cache must be a QuantKVCache (allocate_kv_caches)")
    shape = (cache.num_kv_heads, cache.head_dim)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != shape:
            raise KernelConfigError(f"{name} must be a [num_tokens, {shape[0]}, {shape[1]}] tensor")
        if t.dtype != cache.dtype or t.device != cache.device:
            raise KernelConfigError(
                f"{name} is {t.dtype} on {t.device}; the cache stores {cache.dtype} on "
                f"{cache.device}"
            )
        if t.stride(-1) != 1:
            raise KernelConfigError(f"{name} must have a unit-stride last dimension")
    if key.shape[0] != value.shape[0]:
        raise KernelConfigError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if (
        not isinstance(slot_mapping, torch.Tensor)
        or slot_mapping.dtype not in (torch.int32, torch.int64)
        or slot_mapping.shape != (key.shape[0],)
        or slot_mapping.device != cache.device
    ):
        raise KernelConfigError(
            f"slot_mapping must be an int32/int64 [{key.shape[0]}] tensor on {cache.device}"
        )


def shape_proxy(cache: QuantKVCache) -> torch.Tensor:
    """A zero-stride stand-in ``[num_blocks, 2, bs, H, D]`` in the model dtype on the cache's
    device, so the shared ``check_attention_args`` checks a quantized call exactly as a plain
    one (it reads only shape, dtype, device and the last stride)."""
    if not isinstance(cache, QuantKVCache):
        raise KernelConfigError("cache must be a QuantKVCache (allocate_kv_caches)")
    d = cache.head_dim
    base = torch.empty(d, dtype=cache.dtype, device=cache.device)
    shape = (cache.num_blocks, 2, cache.block_size, cache.num_kv_heads, d)
    return base.as_strided(shape, (0, 0, 0, 0, 1))
