"""Native CPU paged attention over a quantized cache (``cpu_native``): INT8 and FP8.

The codes are widened to fp32 in registers as K and V tiles are loaded: INT8 codes times the
token's fp16 scale (the K scale multiplies the scores, the V scale the probabilities), FP8 by
bit manipulation (E4M3) or as the top byte of a half (E5M2) with the per-head K scale folded
into the query scale and the V scale into the output. Other formats (int4, int2, KIVI) go to
the twin (``supports`` says; the dispatcher, ``quant.attention``, decides), as does a head dim
that is not a multiple of 16. Works in the stored basis, like
every backend (``quant.attention`` rotates query and output).
"""

from __future__ import annotations

import torch

from kvcore_kernels import cpu_native
from kvcore_kernels.checks import check_attention_args
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.checks import shape_proxy


def _fmt_code(cache: QuantKVCache) -> int | None:
    if cache.fmt.kind == "int8":
        return cpu_native.FMT_INT8
    if cache.fmt.kind == "fp8":
        e5m2 = cache.fmt.fp8_dtype == torch.float8_e5m2
        return cpu_native.FMT_E5M2 if e5m2 else cpu_native.FMT_E4M3
    return None


def supports(cache: QuantKVCache) -> bool:
    """Whether the native kernel serves this cache (else the twin does)."""
    return (
        cpu_native.available()
        and cache.device.type == "cpu"
        and _fmt_code(cache) is not None
        and cache.head_dim % 16 == 0
        and (cache.fmt.kind != "fp8" or cache.fp8_scale is not None)
    )


def paged_attention_quant_cpu(
    query: torch.Tensor,
    cache: QuantKVCache,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    rotate_query: bool = False,
) -> torch.Tensor:
    """``paged_attention_quant_torch``'s contract by the native kernel; ``KernelConfigError``
    for a cache it does not serve (``supports``). ``rotate_query``: ``query`` is in the model's
    basis and the kernel rotates it by ``cache.rotation`` once per call, before its items (what
    ``cache.rotate_in(query, "k")`` gives, without a torch matmul per call)."""
    shape = check_attention_args(
        query, shape_proxy(cache), meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
    if not supports(cache):
        raise KernelConfigError(
            f"the native CPU kernel serves int8 and fp8 caches with a head dim multiple of 16, "
            f"not {cache.fmt.name} / {cache.head_dim}"
        )
    if out is None:
        out = torch.empty_like(query)
    layout = cache.layout
    d, bs = cache.head_dim, cache.block_size
    fp8_scale = None
    if cache.fmt.kind == "fp8":
        fp8_scale = cache.fp8_scale.float().contiguous()
    scale_region = layout.regions.get("scale")
    return cpu_native.run(
        query,
        out,
        meta,
        kv_ptr=cache.buffer.data_ptr() + layout.regions["data"].offset,
        fmt=_fmt_code(cache),
        strides=(cache.buffer.stride(0), d, layout.head_bytes, bs * d),
        scale_offset=(scale_region.offset - layout.regions["data"].offset) if scale_region else 0,
        num_kv_heads=shape.num_kv_heads,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        alibi_slopes=alibi_slopes,
        fp8_scale=fp8_scale,
        q_rotation=_rotation(cache) if rotate_query else None,
    )


def _rotation(cache: QuantKVCache) -> torch.Tensor:
    r = cache.rotation
    if r is None or r.dtype != torch.float32 or r.shape != (cache.head_dim, cache.head_dim):
        raise KernelConfigError("rotate_query needs the cache's float32 [D, D] rotation")
    return r if r.is_contiguous() else r.contiguous()
