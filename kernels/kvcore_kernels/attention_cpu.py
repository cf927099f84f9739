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
