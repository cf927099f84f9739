"""Argument checks the plain-cache backends share (bottom layer: no kernel imports).

``check_attention_call`` checks a paged-attention call and returns it normalised (the quantized
path checks through it too, with ``quant.checks.shape_proxy`` standing in for its cache);
``check_store_args`` a cache write.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from kvcore_kernels.cache import check_kv_cache
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata


@dataclass(frozen=True)
class AttentionShape:
    """Sizes a call was checked against."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True)
class AttentionCall:
    """A checked ``paged_attention`` call: its sizes and its options, normalised."""

    shape: AttentionShape
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    alibi_slopes: torch.Tensor | None
    out: torch.Tensor  # the caller's, or a new tensor like the query
    block_mass: torch.Tensor | None


def check_attention_call(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    options: dict,
) -> AttentionCall:
    """``check_attention_args`` and ``check_block_mass`` over ``options`` (``scale`` and the
    optional ``sliding_window``, ``soft_cap``, ``alibi_slopes``, ``out``, ``block_mass``
    keywords of ``paged_attention``); numbers become plain floats and ints, ``out`` is
    allocated if None. Raises ``KernelConfigError``."""
    opts = dict(sliding_window=None, soft_cap=None, alibi_slopes=None, out=None, block_mass=None)
    unknown = set(options) - set(opts) - {"scale"}
    if unknown:
        raise KernelConfigError(f"unknown paged_attention options {sorted(unknown)}")
    opts.update(options)
    window, cap, out = opts["sliding_window"], opts["soft_cap"], opts["out"]
    shape = check_attention_args(
        query, kv_cache, meta, options.get("scale"), window, cap, opts["alibi_slopes"], out
    )
    check_block_mass(opts["block_mass"], meta, query.device)
    return AttentionCall(
        shape=shape,
        scale=float(options["scale"]),
        sliding_window=None if window is None else int(window),
        soft_cap=None if cap is None else float(cap),
        alibi_slopes=opts["alibi_slopes"],
        out=torch.empty_like(query) if out is None else out,
        block_mass=opts["block_mass"],
    )


def check_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    alibi_slopes: torch.Tensor | None,
    out: torch.Tensor | None,
) -> AttentionShape:
    """Checks shared by both backends; raises ``KernelConfigError``."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    if not isinstance(meta, AttentionMetadata):
        raise KernelConfigError("meta must come from plan_attention")
    if block_size != meta.block_size:
        raise KernelConfigError(f"kv_cache block_size {block_size} != planned {meta.block_size}")
    if meta.max_block_id >= num_blocks:
        raise KernelConfigError(
            f"block_table uses block {meta.max_block_id}, kv_cache has {num_blocks} blocks"
        )
    if kv_cache.device != meta.device:
        raise KernelConfigError(f"kv_cache is on {kv_cache.device}, meta on {meta.device}")
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise KernelConfigError("query must be a [num_tokens, num_q_heads, head_dim] tensor")
    num_q_heads = query.shape[1]
    if query.shape[0] != meta.num_tokens or query.shape[2] != head_dim:
        raise KernelConfigError(
            f"query must be [{meta.num_tokens}, num_q_heads, {head_dim}], got {tuple(query.shape)}"
        )
    if num_q_heads % num_kv_heads != 0:
        raise KernelConfigError(
            f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if query.dtype != kv_cache.dtype or query.device != kv_cache.device:
        raise KernelConfigError(
            f"query is {query.dtype} on {query.device}, kv_cache {kv_cache.dtype} on "
            f"{kv_cache.device}"
        )
    if query.stride(-1) != 1:
        raise KernelConfigError("query must have a unit-stride last dimension")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise KernelConfigError(f"scale must be a number, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise KernelConfigError(f"scale must be finite and > 0, got {scale}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, numbers.Integral)
        or sliding_window < 1
    ):
        raise KernelConfigError(
            f"sliding_window must be None or an int >= 1, got {sliding_window!r}"
        )
    if soft_cap is not None and (
        isinstance(soft_cap, bool)
        or not isinstance(soft_cap, numbers.Real)
        or not (math.isfinite(soft_cap) and soft_cap > 0)
    ):
        raise KernelConfigError(f"soft_cap must be None or a finite number > 0, got {soft_cap!r}")
    if alibi_slopes is not None and (
        not isinstance(alibi_slopes, torch.Tensor)
        or alibi_slopes.shape != (num_q_heads,)
        or alibi_slopes.dtype != torch.float32
        or alibi_slopes.device != query.device
    ):
        raise KernelConfigError(
            f"alibi_slopes must be a float32 [{num_q_heads}] tensor on {query.device}"
        )
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != query.shape
        or out.dtype != query.dtype
        or out.device != query.device
        or out.stride(-1) != 1
    ):
        raise KernelConfigError(
            "out must be a tensor of the query's shape, dtype and device with a unit-stride "
            "last dimension"
        )
    return AttentionShape(num_q_heads, num_kv_heads, head_dim, block_size)


def check_store_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[int, int, int, int]:
    """Checks both backends share; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise KernelConfigError(f"{name} must be a torch.Tensor")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise KernelConfigError(
                f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}"
            )
        if t.dtype != kv_cache.dtype:
            raise KernelConfigError(f"{name} dtype {t.dtype} != kv_cache dtype {kv_cache.dtype}")
        if t.device != kv_cache.device:
            raise KernelConfigError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
        if t.stride(-1) != 1:
            raise KernelConfigError(f"{name} must have a unit-stride last dimension")
    if key.shape[0] != value.shape[0]:
        raise KernelConfigError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise KernelConfigError("slot_mapping must be an int32 or int64 tensor")
    if slot_mapping.shape != (key.shape[0],):
        raise KernelConfigError(
            f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != kv_cache.device:
        raise KernelConfigError(f"slot_mapping is on {slot_mapping.device}, kv_cache elsewhere")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_block_mass(block_mass: torch.Tensor | None, meta: AttentionMetadata, device) -> None:
    """``block_mass`` is None or a contiguous float32 [num_reqs, max_blocks] tensor on
    ``device`` (the block table's shape): the attention mass side output (H2O)."""
    if block_mass is None:
        return
    want = tuple(meta.block_table.shape)
    if (
        not isinstance(block_mass, torch.Tensor)
        or tuple(block_mass.shape) != want
        or block_mass.dtype != torch.float32
        or block_mass.device != device
        or not block_mass.is_contiguous()
    ):
        raise KernelConfigError(
            f"block_mass must be a contiguous float32 {list(want)} tensor (the block table's "
            f"shape) on {device}"
        )
