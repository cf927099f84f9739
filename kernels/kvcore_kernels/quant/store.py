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
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.codecs import (
    decode_tokens,
    encode_tokens,
    fp8_calibrate,
    kivi_decode_blocks,
    kivi_encode_blocks,
)
from kvcore_kernels.quant.formats import token_regions
from kvcore_kernels.quant.residual import StorePlan


def check_quant_store_args(
    key: torch.Tensor, value: torch.Tensor, cache: QuantKVCache, slot_mapping: torch.Tensor
) -> None:
    """Checks shared by both backends; raises ``KernelConfigError``."""
    if not isinstance(cache, QuantKVCache):
        raise KernelConfigError("cache must be a QuantKVCache (allocate_kv_caches)")
    shape = (cache.num_kv_heads, cache.head_dim)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != shape:
            raise KernelConfigError(f"{name} must be a [num_tokens, {shape[0]}, {shape[1]}] tensor")
        if t.dtype != cache.dtype or t.device != cache.device:
            raise KernelConfigError(
                f"{name} is {t.dtype} on {t.device}; the cache stores {cache.dtype} on "
                f"{cache.device}"
            )
        if t.stride(-1) != 1:
            raise KernelConfigError(f"{name} must have a unit-stride last dimension")
    if key.shape[0] != value.shape[0]:
        raise KernelConfigError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if (
        not isinstance(slot_mapping, torch.Tensor)
        or slot_mapping.dtype not in (torch.int32, torch.int64)
        or slot_mapping.shape != (key.shape[0],)
        or slot_mapping.device != cache.device
    ):
        raise KernelConfigError(
            f"slot_mapping must be an int32/int64 [{key.shape[0]}] tensor on {cache.device}"
        )


def calibrate_fp8(cache: QuantKVCache, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set an uncalibrated FP8 cache's scales from this K/V (no-op once calibrated)."""
    if cache.fmt.kind != "fp8" or cache.fp8_calibrated or key.shape[0] == 0:
        return
    assert cache.fp8_scale is not None
    cache.fp8_scale[0] = fp8_calibrate(cache.fmt, key)
    cache.fp8_scale[1] = fp8_calibrate(cache.fmt, value)
    cache.fp8_calibrated = True


def _kept(cache: QuantKVCache, slot_mapping: torch.Tensor):
    """(tokens, blocks, offsets) of the real slots; raises on a slot past the cache's end."""
    bs = cache.block_size
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and int(slots.max()) >= cache.num_blocks * bs:
        raise KernelConfigError(f"slot {int(slots.max())} is past the cache's end")
    keep = torch.nonzero(slots >= bs).squeeze(1)
    slots = slots[keep]
    return keep, torch.div(slots, bs, rounding_mode="floor"), slots % bs


def store_tokens_torch(
    key: torch.Tensor, value: torch.Tensor, cache: QuantKVCache, slot_mapping: torch.Tensor
) -> None:
    """Torch twin of the per-token quantizing store (fp8, int8, int4, int2)."""
    keep, blocks, offsets = _kept(cache, slot_mapping)
    if keep.numel() == 0:
        return
    for which, x in ((0, key), (1, value)):
        scale = cache.fp8_scale[which] if cache.fp8_scale is not None else None
        parts = encode_tokens(cache.fmt, x.index_select(0, keep), scale, which)
        for part, (name, per_kv) in token_regions(cache.fmt, which).items():
            view = cache.views[name][:, which] if per_kv else cache.views[name]
            view.index_put_((blocks, offsets), parts[part])


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


def encode_blocks_torch(
    cache: QuantKVCache,
    src: torch.Tensor,
    src_index: torch.Tensor,
    dst_blocks: torch.Tensor,
    fills: torch.Tensor | None,
) -> None:
    """Torch twin of the KIVI block encoder (keys per channel, values per token)."""
    blocks = src.index_select(0, src_index)  # [n, 2, bs, H, D]
    parts = kivi_encode_blocks(cache.fmt, blocks[:, 0], blocks[:, 1], fills)
    cache.write_blocks(dst_blocks, parts)


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
        keep, _, _ = _kept(cache, slot_mapping)
        calibrate_fp8(cache, key.index_select(0, keep), value.index_select(0, keep))
    if use_triton:
        from kvcore_kernels.quant.store_triton import store_tokens_triton

        store_tokens_triton(key, value, cache, slot_mapping)
    else:
        store_tokens_torch(key, value, cache, slot_mapping)


def read_tokens(cache: QuantKVCache, blocks: torch.Tensor, which: int) -> torch.Tensor:
    """Decode K (0) or V (1) of whole blocks: float32 ``[n, bs, H, D]`` (test and twin helper),
    in the stored basis (``cache.rotate_out`` undoes a rotation). KIVI blocks held in the
    residual are read from it (model dtype), as attention does.
    """
    parts = cache.read_blocks(blocks)
    if cache.fmt.kind == "kivi":
        out = kivi_decode_blocks(cache.fmt, parts, which)
        assert cache.residual is not None and cache.residual_state is not None
        stage = cache.residual_state.device_map.index_select(0, blocks).to(torch.int64)
        staged = torch.nonzero(stage >= 0).squeeze(1)
        if staged.numel():
            rows = cache.residual[:, which].index_select(0, stage[staged]).float()
            out.index_copy_(0, staged, rows)
        return out
    n, bs = blocks.numel(), cache.block_size
    flat = {}
    for part, (name, per_kv) in token_regions(cache.fmt, which).items():
        t = parts[name][:, which] if per_kv else parts[name]  # [n, bs, H, ...]
        flat[part] = t.reshape(n * bs, *t.shape[2:])
    scale = cache.fp8_scale[which] if cache.fp8_scale is not None else None
    out = decode_tokens(cache.fmt, flat, scale, which)
    return out.view(n, bs, cache.num_kv_heads, cache.head_dim)
