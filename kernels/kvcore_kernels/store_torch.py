"""Pure-torch cache write (the CPU path and the Triton store's twin)."""

from __future__ import annotations

import torch

from kvcore_kernels.checks import check_store_args
from kvcore_kernels.errors import KernelConfigError


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
