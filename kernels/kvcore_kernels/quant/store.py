"""Quantizing cache write: encode a step's new K and V (packed tokens) into their slots.

Per-token formats (fp8, int8, int4, int2) encode every token into its slot. KIVI routes tokens
through the residual plan (``residual`` module): tokens go to the model-dtype residual and a
block is encoded (keys per channel, values per token) at the step after it became full. FP8
caches without given scales calibrate them on their first call (amax of that call's K and V,
per head or per tensor, times a headroom of ``FP8_MARGIN``). Slots in the null block and
negative slots (padding) are skipped, as in ``store_kv``.
"""

from __future__ import annotations

import torch

from kvcore_kernels.cache import check_backend
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.checks import check_quant_store_args
from kvcore_kernels.quant.codecs import kivi_decode_blocks
from kvcore_kernels.quant.residual import StorePlan
from kvcore_kernels.quant.store_torch import (
    calibrate_fp8,
    encode_blocks_torch,
    kept_slots,
    store_tokens_torch,
)


def apply_residual_plan(
    cache: QuantKVCache,
    plan: StorePlan,
    key: torch.Tensor,
    value: torch.Tensor,
    encode_blocks,
) -> None:
    """Run one layer's share of a KIVI step plan: finalize, restage, then write the tokens.

    ``encode_blocks(cache, src, src_index, dst_blocks, fills)`` quantizes ``src[src_index]``
    (``[n, 2, bs, H, D]``, model dtype) into ``dst_blocks``: the torch twin or the Triton kernel.
    """
    res = cache.residual
    assert res is not None
    if plan.final_blocks.numel():
        encode_blocks(cache, res, plan.final_slots, plan.final_blocks, plan.final_fills)
    if plan.restage_blocks.numel():
        parts = cache.read_blocks(plan.restage_blocks)
        for which in (0, 1):
            decoded = kivi_decode_blocks(cache.fmt, parts, which).to(res.dtype)
            res[:, which].index_copy_(0, plan.restage_slots, decoded)
    if plan.stage_tokens.numel():
        where = (plan.stage_slots, plan.stage_offsets)
        res[:, 0].index_put_(where, key.index_select(0, plan.stage_tokens))
        res[:, 1].index_put_(where, value.index_select(0, plan.stage_tokens))


def store_kv_quant(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: QuantKVCache,
    slot_mapping: torch.Tensor,
    *,
    meta: object = None,
    backend: str = "auto",
) -> None:
    """Quantize ``key``/``value`` ``[num_tokens, H, D]`` into ``cache`` at ``slot_mapping``.

    ``meta``: the step's ``AttentionMetadata``, needed only by KIVI with ``kivi_window > 0``.
    ``backend``: "auto" (Triton on CUDA, the torch twin otherwise), "triton" or "torch".
    """
    check_quant_store_args(key, value, cache, slot_mapping)
    use_triton = check_backend(backend, cache.device) == "triton"
    key, value = cache.rotate_in(key, "k"), cache.rotate_in(value, "v")
    if cache.fmt.kind == "kivi":
        assert cache.residual_state is not None
        plan = cache.residual_state.plan_for(cache, slot_mapping, meta)
        if use_triton:
            from kvcore_kernels.quant.kivi_triton import encode_blocks_triton as encode
        else:
            encode = encode_blocks_torch
        apply_residual_plan(cache, plan, key, value, encode)
        return
    if cache.fmt.kind == "fp8" and not cache.fp8_calibrated:
        keep, _, _ = kept_slots(cache, slot_mapping)
        calibrate_fp8(cache, key.index_select(0, keep), value.index_select(0, keep))
    if use_triton:
        from kvcore_kernels.quant.store_triton import store_tokens_triton

        store_tokens_triton(key, value, cache, slot_mapping)
    else:
        store_tokens_torch(key, value, cache, slot_mapping)
