"""A step's K/V store + paged attention for every layer, checked once per geometry (CPU).

Above the dispatchers (``store``, ``attention``): it calls their checked entry points on a step's
first layer of each geometry and the native store and kernel (``cpu_native``) straight for the
rest. kvcore's model code holds one per step (``kvcore.runner.native.NativeStep``).
"""

from __future__ import annotations

import torch

from kvcore_kernels import cpu_native
from kvcore_kernels.attention import paged_attention
from kvcore_kernels.attention_cpu import FORMATS, supports
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.store import store_kv


class LayerCalls:
    """One step's ``store_kv`` + ``paged_attention`` for every layer, the argument checks done
    once per geometry instead of per layer.

    A step calls both once per layer with the same metadata, slots and shapes; only the
    tensors' addresses change. The first call of a geometry (the tensors' shapes, dtypes,
    strides and device, the metadata and slots objects, ``scale``, ``sliding_window`` and
    ``soft_cap``) runs the checked entry points (``kvcore_kernels.store_kv`` and
    ``paged_attention``, backend "auto"); where they resolved to the native store and kernel,
    the later calls of that geometry go straight to ``cpu_native.store`` and ``cpu_native.run``.
    Anything else (a quantized or CUDA cache, ``block_mass``, ALiBi, a layout the native copy
    does not take) keeps the checked path on every call. Hold one per step: it keeps the step's
    metadata and slots alive (their ``id`` is part of the key). At batch 1 the checks were ~25 us
    of a layer's ~60 us of attention (docs/kernels.md, "Per-step checks").
    """

    __slots__ = ("_fast", "_keep")

    def __init__(self) -> None:
        self._fast: dict[tuple, tuple] = {}
        self._keep: list[object] = []

    @property
    def fast(self) -> bool:
        """Whether some geometry of this step resolved to the native store and kernel."""
        return bool(self._fast)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        if not isinstance(kv_cache, torch.Tensor):  # a quantized cache: always checked
            cpu_native.flush()  # (the checked paths may read q, k, v with torch)
            store_kv(key, value, kv_cache, slot_mapping, meta=meta)
            return paged_attention(
                query, kv_cache, meta, scale=scale, sliding_window=sliding_window,
                soft_cap=soft_cap,
            )  # fmt: skip
        geometry = (
            id(meta), id(slot_mapping), scale, sliding_window, soft_cap,
            query.shape, query.dtype, query.stride(), key.shape, key.stride(), value.stride(),
            kv_cache.shape, kv_cache.dtype, kv_cache.stride(), kv_cache.device,
        )  # fmt: skip
        fast = self._fast.get(geometry)
        if fast is not None:
            slots, fmt, strides, num_kv_heads = fast
            if cpu_native.store(key, value, kv_cache, slots):
                out = torch.empty_like(query)
                return cpu_native.run(
                    query, out, meta, kv_ptr=kv_cache.data_ptr(), fmt=fmt, strides=strides,
                    scale_offset=0, num_kv_heads=num_kv_heads, scale=scale,
                    sliding_window=sliding_window, soft_cap=soft_cap, alibi_slopes=None,
                    fp8_scale=None,
                )  # fmt: skip
            cpu_native.flush()
            store_kv(key, value, kv_cache, slot_mapping, meta=meta)  # not reached: same layout
        else:
            cpu_native.flush()
            store_kv(key, value, kv_cache, slot_mapping, meta=meta)
        out = paged_attention(
            query, kv_cache, meta, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
        )
        if kv_cache.device.type == "cpu" and supports(kv_cache):
            # the checked calls above passed and took the native kernel
            size = kv_cache.element_size()
            strides = (kv_cache.stride(0) * size, kv_cache.stride(2) * size,
                       kv_cache.stride(3) * size, kv_cache.stride(1) * size)  # fmt: skip
            slots = slot_mapping.to(torch.int64).contiguous()
            self._fast[geometry] = (slots, FORMATS[kv_cache.dtype], strides, kv_cache.shape[3])
            self._keep.extend((meta, slot_mapping))
        return out
