"""Cache write: put a step's new K and V (packed tokens) into their slots, in place.

``slot_mapping[t]`` is the slot of token ``t``; slots in the null block (``slot < block_size``)
and negative slots (padding) are skipped. Two tokens with one slot: one of them wins.
"""

from __future__ import annotations

import torch

from kvcore_kernels import cpu_native
from kvcore_kernels.cache import check_backend, check_kv_cache
from kvcore_kernels.checks import check_store_args
from kvcore_kernels.store_torch import store_kv_torch


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

    ``backend``: "auto" (Triton on CUDA; on the CPU the native row copy of ``cpu_native``,
    where the extension is built and the layout allows, else the torch twin), "triton",
    "torch" (the twin) or "cpu" (native where it can, else the twin).
    A ``kvcore_kernels.quant.QuantKVCache`` is quantized on write (``store_kv_quant``; ``meta``,
    the step's ``AttentionMetadata``, is needed only by KIVI with a residual window).
    """
    if not isinstance(kv_cache, torch.Tensor):
        from kvcore_kernels.quant.cache import QuantKVCache
        from kvcore_kernels.quant.store import store_kv_quant

        if isinstance(kv_cache, QuantKVCache):
            store_kv_quant(key, value, kv_cache, slot_mapping, meta=meta, backend=backend)
            return
    check_kv_cache(kv_cache)
    resolved = check_backend(backend, kv_cache.device)
    if resolved == "triton":
        from kvcore_kernels.store_triton import store_kv_triton

        store_kv_triton(key, value, kv_cache, slot_mapping)
        return
    if resolved == "cpu" or (backend == "auto" and kv_cache.device.type == "cpu"):
        check_store_args(key, value, kv_cache, slot_mapping)
        if cpu_native.store(key, value, kv_cache, slot_mapping):
            return
    store_kv_torch(key, value, kv_cache, slot_mapping)
