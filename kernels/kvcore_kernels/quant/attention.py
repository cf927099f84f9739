"""Paged attention over a quantized cache: the entry point (dequantization in the load path)."""

from __future__ import annotations

import torch

from kvcore_kernels.cache import check_backend
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.quant.cache import QuantKVCache


def paged_attention_quant(
    query: torch.Tensor,
    cache: QuantKVCache,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``paged_attention``'s contract over a ``QuantKVCache``: K/V are decoded as they are
    loaded, per tile (Triton) or per gathered chunk (torch twin), never for the whole cache.
    ``backend``: "auto" (Triton on CUDA, the torch twin otherwise), "triton" or "torch"."""
    if not isinstance(cache, QuantKVCache):
        raise KernelConfigError("cache must be a QuantKVCache (allocate_kv_caches)")
    if check_backend(backend, cache.device) == "triton":
        from kvcore_kernels.quant.attention_triton import paged_attention_quant_triton as run
    else:
        from kvcore_kernels.quant.attention_torch import paged_attention_quant_torch as run
    return run(
        query,
        cache,
        meta,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        alibi_slopes=alibi_slopes,
        out=out,
    )
