"""Pure-torch quantizing store (the CPU path and the Triton encoders' twins).

``store_tokens_torch`` encodes per-token formats into their slots, ``encode_blocks_torch``
KIVI's full blocks (``quant.read_torch.read_tokens`` decodes them back).
"""

from __future__ import annotations

import torch

from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.codecs import (
    encode_tokens,
    fp8_calibrate,
    kivi_encode_blocks,
)
from kvcore_kernels.quant.formats import token_regions


def calibrate_fp8(cache: QuantKVCache, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set an uncalibrated FP8 cache's scales from this K/V (no-op once calibrated)."""
    if cache.fmt.kind != "fp8" or cache.fp8_calibrated or key.shape[0] == 0:
        return
    assert cache.fp8_scale is not None
    cache.fp8_scale[0] = fp8_calibrate(cache.fmt, key)
    cache.fp8_scale[1] = fp8_calibrate(cache.fmt, value)
    cache.fp8_calibrated = True


def kept_slots(cache: QuantKVCache, slot_mapping: torch.Tensor):
    """(tokens, blocks, offsets) of the real slots; raises on a slot past the cache's end."""
    bs = cache.block_size
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and int(slots.max()) >= cache.num_blocks * bs:
        raise KernelConfigError(f"slot {int(slots.max())} is past the cache's end")
    keep = torch.nonzero(slots >= bs).squeeze(1)
    slots = slots[keep]
    return keep, torch.div(slots, bs, rounding_mode="floor"), slots % bs


def store_tokens_torch(
    key: torch.Tensor, value: torch.Tensor, cache: QuantKVCache, slot_mapping: torch.Tensor
) -> None:
    """Torch twin of the per-token quantizing store (fp8, int8, int4, int2)."""
    keep, blocks, offsets = kept_slots(cache, slot_mapping)
    if keep.numel() == 0:
        return
    for which, x in ((0, key), (1, value)):
        scale = cache.fp8_scale[which] if cache.fp8_scale is not None else None
        parts = encode_tokens(cache.fmt, x.index_select(0, keep), scale, which)
        for part, (name, per_kv) in token_regions(cache.fmt, which).items():
            view = cache.views[name][:, which] if per_kv else cache.views[name]
            view.index_put_((blocks, offsets), parts[part])


def encode_blocks_torch(
    cache: QuantKVCache,
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst_blocks: torch.Tensor,
    fills: torch.Tensor | None,
) -> None:
    """Torch twin of the KIVI block encoder (keys per channel, values per token)."""
    blocks = src.index_select(0, src_index)  # [n, 2, bs, H, D]
    parts = kivi_encode_blocks(cache.fmt, blocks[:, 0], blocks[:, 1], fills)
    cache.write_blocks(dst_blocks, parts)
