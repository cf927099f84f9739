"""Native CPU paged attention over a plain cache (``cpu_native``): the CPU backend "cpu".

Same contract as ``paged_attention_torch``. What the kernel does not take (``supports`` says;
the dispatcher, ``kvcore_kernels.attention``, sends it to the twin): ``block_mass`` (H2O's
attention mass; the kernel never forms normalised probabilities per key) and head dims that are
not a multiple of 16. Released blocks (null block-table entries) are supported: their keys get
zero weight and are never read.
"""

from __future__ import annotations

import torch

from kvcore_kernels import cpu_native
from kvcore_kernels.checks import check_attention_args, check_block_mass
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata

FORMATS = {torch.float32: cpu_native.FMT_F32, torch.bfloat16: cpu_native.FMT_BF16,
           torch.float16: cpu_native.FMT_F16}  # fmt: skip


def supports(kv_cache: torch.Tensor, block_mass: torch.Tensor | None = None) -> bool:
    """Whether the native kernel serves this call (else the twin does)."""
    return (
        cpu_native.available()
        and kv_cache.device.type == "cpu"
        and block_mass is None
        and kv_cache.shape[-1] % 16 == 0
        and kv_cache.dtype in FORMATS
    )


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` on the CPU by the native kernel; ``KernelConfigError`` for a call
    it does not serve (``supports``)."""
    shape = check_attention_args(
        query, kv_cache, meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
    check_block_mass(block_mass, meta, query.device)
    if not supports(kv_cache, block_mass):
        raise KernelConfigError(
            "the native CPU kernel needs the extension, a CPU cache in fp32/bf16/fp16, a head "
            "dim multiple of 16 and no block_mass"
        )
    if out is None:
        out = torch.empty_like(query)
    size = kv_cache.element_size()
    return cpu_native.run(
        query,
        out,
        meta,
        kv_ptr=kv_cache.data_ptr(),
        fmt=FORMATS[kv_cache.dtype],
        strides=(
            kv_cache.stride(0) * size,
            kv_cache.stride(2) * size,
            kv_cache.stride(3) * size,
            kv_cache.stride(1) * size,
        ),
        scale_offset=0,
        num_kv_heads=shape.num_kv_heads,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        alibi_slopes=alibi_slopes,
        fp8_scale=None,
    )


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
        from kvcore_kernels import paged_attention, store_kv

        if not isinstance(kv_cache, torch.Tensor):  # a quantized cache: always checked
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
            store_kv(key, value, kv_cache, slot_mapping, meta=meta)  # not reached: same layout
        else:
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
