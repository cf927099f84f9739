"""Whole-block operations on a layer stack: ``copy_blocks`` (copy-on-write, tier moves) and the
KIVI residual flush it needs first (``encode_residual``: Triton on CUDA, the torch twin
elsewhere).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvcore_kernels.cache import check_backend
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.store_torch import encode_blocks_torch


def encode_residual(
    cache: QuantKVCache, slots: torch.Tensor, blocks: torch.Tensor, fills, backend: str
) -> None:
    """Quantize residual ``slots`` of a KIVI layer into ``blocks`` (Triton on CUDA)."""
    if check_backend(backend, cache.device) == "triton":
        from kvcore_kernels.quant.kivi_triton import encode_blocks_triton as encode
    else:
        encode = encode_blocks_torch
    encode(cache, cache.residual, slots, blocks, fills)


def copy_blocks(
    caches: Sequence[torch.Tensor | QuantKVCache], src, dst, *, backend: str = "auto"
) -> None:
    """Copy blocks ``src[i] -> dst[i]`` in every layer, metadata and KIVI residual included.

    The copy-on-write / tier-move primitive: plain caches copy their block rows, quantized
    ones their byte rows (codes and scales together), KIVI layers also their residual slots
    (after quantizing the blocks the last step filled, so only partial ones need a slot).
    ``src``/``dst``: int sequences, NumPy arrays or int tensors of equal length.
    """
    src_np = np.asarray(src.cpu() if isinstance(src, torch.Tensor) else src, dtype=np.int64)
    dst_np = np.asarray(dst.cpu() if isinstance(dst, torch.Tensor) else dst, dtype=np.int64)
    if src_np.shape != dst_np.shape or src_np.ndim != 1:
        raise KernelConfigError("src and dst must be 1-D and of equal length")
    if src_np.size == 0 or not caches:
        return
    first = caches[0]
    num_blocks = first.num_blocks if isinstance(first, QuantKVCache) else first.shape[0]
    if min(src_np.min(), dst_np.min()) < 0 or max(src_np.max(), dst_np.max()) >= num_blocks:
        raise KernelConfigError(f"copy_blocks: block ids must be in [0, {num_blocks})")
    states = {
        id(c.residual_state): c.residual_state
        for c in caches
        if isinstance(c, QuantKVCache) and c.residual_state is not None
    }
    flushes = {key: st.take_pending() for key, st in states.items()}
    for cache in caches:
        if isinstance(cache, QuantKVCache) and cache.residual_state is not None:
            blocks, slots, fills = flushes[id(cache.residual_state)]
            if blocks.numel():
                encode_residual(cache, slots, blocks, fills, backend)
    slot_copies = {key: st.plan_copy(src_np, dst_np) for key, st in states.items()}
    for cache in caches:
        rows = cache.buffer if isinstance(cache, QuantKVCache) else cache
        s = torch.from_numpy(src_np).to(rows.device)
        d = torch.from_numpy(dst_np).to(rows.device)
        rows.index_copy_(0, d, rows.index_select(0, s))
        if isinstance(cache, QuantKVCache) and cache.residual is not None:
            from_slots, to_slots = slot_copies[id(cache.residual_state)]
            if from_slots.numel():
                cache.residual.index_copy_(0, to_slots, cache.residual.index_select(0, from_slots))
