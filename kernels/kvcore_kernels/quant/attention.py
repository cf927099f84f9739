"""Paged attention over a quantized cache: the entry point (dequantization in the load path)."""

from __future__ import annotations

import functools

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
    backend: str = "auto",
    **options,
) -> torch.Tensor:
    """``paged_attention``'s contract over a ``QuantKVCache`` (``options``: its keywords,
    ``scale`` and the optional ``sliding_window``, ``soft_cap``, ``alibi_slopes``, ``out``;
    released blocks included; ``block_mass`` is for plain caches only). K/V are decoded as
    they are loaded, per tile (Triton) or per gathered chunk (torch twin), never for the whole
    cache. ``backend``: "auto" (Triton on CUDA; on the CPU the native kernel for int8 / fp8,
    the torch twin otherwise), "triton", "torch" or "cpu" (native where it serves, else the
    twin).
    Rotated caches get ``query @ R`` (scores unchanged) and, for rotated values, the output
    rotated back; the backends themselves work in the stored basis."""
    if not isinstance(cache, QuantKVCache):
        raise KernelConfigError("cache must be a QuantKVCache (allocate_kv_caches)")
    if options.get("block_mass") is not None:
        raise KernelConfigError(
            "block_mass (attention mass per block) is supported on plain caches only, not on "
            "quantized ones"
        )
    options.pop("block_mass", None)
    resolved = check_backend(backend, cache.device)
    native_cpu = False
    if resolved == "triton":
        from kvcore_kernels.quant.attention_triton import paged_attention_quant_triton as run
    else:
        attention_cpu, run = _cpu_backends()
        native = resolved == "cpu" or (backend == "auto" and cache.device.type == "cpu")
        if native and attention_cpu.supports(cache):
            run, native_cpu = attention_cpu.paged_attention_quant_cpu, True
    out = options.pop("out", None)
    rotated_v = "v" in cache.rotate
    if native_cpu and "k" in cache.rotate:
        # the native kernel rotates the query rows once per call, before its items
        options["rotate_query"] = True
    elif isinstance(query, torch.Tensor):
        query = cache.rotate_in(query, "k")
    result = run(query, cache, meta, out=None if rotated_v else out, **options)
    if not rotated_v:
        return result
    result = cache.rotate_out(result, "v")
    if out is None:
        return result
    return out.copy_(result)


@functools.cache
def _cpu_backends():
    """The native CPU backend's module and the torch twin, imported on the first call (an
    import statement per call cost ~1 us each)."""
    from kvcore_kernels.quant import attention_cpu
    from kvcore_kernels.quant.attention_torch import paged_attention_quant_torch

    return attention_cpu, paged_attention_quant_torch
