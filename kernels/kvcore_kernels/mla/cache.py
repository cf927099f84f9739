"""The latent (MLA) cache layout, its allocation and the checks both MLA backends share.

Bottom layer of the MLA kernels: it imports only ``errors``, ``cache`` (backend choice) and
``plan`` (the metadata type); the backends (``mla.attention_torch``,
``mla.attention_triton``: latent store and attention each) sit above it and the dispatcher
(``mla.attention``) on top. Nothing here imports a backend.

Layout (per layer, one tensor, the model's dtype). DeepSeek's Multi-head Latent Attention caches
one latent per token, shared by every head: the compressed ``c_kv`` (after ``kv_a_layernorm``)
and the shared rotary key ``k_pe`` (after RoPE)::

    latent_cache: [num_blocks, block_size, kv_lora_rank + rope_dim]
                  row = [ c_kv (kv_lora_rank) | k_pe (rope_dim) ]
    slot = block_id * block_size + offset      (offset in [0, block_size))

Bytes per token per layer: ``(kv_lora_rank + rope_dim) * itemsize`` (DeepSeek-V3 in bf16:
576 * 2 = 1,152 bytes, where caching the up-projected K and V of its 128 heads would take
128 * (192 + 128) * 2 = 81,920). Block 0 is the null block, as in the plain layout.

FP8 variant (``allocate_latent_fp8_cache``): one uint8 row per block, so copy-on-write and
preemption copy whole rows exactly like the plain layout::

    latent_fp8_cache: uint8 [num_blocks, fp8_row_bytes(block_size, width)]
                      row = [ scale (float32) | codes float8_e4m3fn [block_size, width] | pad ]
    value = code * scale[block]          scale = max |value| in the block / 448

``width + 4 / block_size`` bytes per token per layer (DeepSeek-V3: 576.25).

The attention both backends compute, for query token ``t`` (position ``p``) and head ``h``
(``W_uk[h]``: [qk_nope, r] and ``W_uv[h]``: [v_dim, r] are the per-head slices of
``kv_b_proj``)::

    score(t, h, j) = scale * (q_nope[t, h] . (W_uk[h] c_kv[j]) + q_pe[t, h] . k_pe[j]),  j <= p
    out[t, h]      = W_uv[h] sum_j softmax_j(score) c_kv[j]                    [v_dim]

Absorbed form (decode): ``q_lat = W_uk[h]^T q_nope`` ([r]), so the scores are one dot of
``[q_lat | q_pe]`` with the cached row and the output is ``W_uv[h]`` applied once to the
attention-weighted latent: no per-head K or V is ever built. Expanded form (long prefill
chunks): up-project the keys' latents to per-head K and V and attend as usual.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from kvcore_kernels.cache import SUPPORTED_DTYPES
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class MLAShape:
    """Sizes an MLA call was checked against."""

    num_heads: int
    kv_lora_rank: int  # r: width of c_kv
    rope_dim: int  # width of k_pe / q_pe
    nope_dim: int  # width of q_nope (and of each head's up-projected non-rotary key)
    v_dim: int  # width of each head's value
    block_size: int
    dtype: torch.dtype  # of the queries, weights and output (the cache's, unless FP8)
    fp8: bool  # the cache holds FP8 rows with a per-block scale


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise KernelConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def allocate_latent_cache(
    num_blocks: int,
    block_size: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed latent cache ``[num_blocks, block_size, kv_lora_rank + rope_dim]``."""
    _check_int("num_blocks", num_blocks, 2)
    _check_int("block_size", block_size, 1)
    _check_int("kv_lora_rank", kv_lora_rank, 1)
    _check_int("rope_dim", rope_dim, 0)
    if dtype not in SUPPORTED_DTYPES:
        raise KernelConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    return torch.zeros(
        (num_blocks, block_size, kv_lora_rank + rope_dim), dtype=dtype, device=device
    )


def latent_bytes_per_token(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token takes in one layer's latent cache."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (_check_int("kv_lora_rank", kv_lora_rank, 1) + _check_int("rope_dim", rope_dim, 0)) * (
        itemsize
    )


def fp8_row_bytes(block_size: int, width: int) -> int:
    """Bytes of one FP8 latent block row: a float32 scale, then ``block_size * width`` codes,
    padded to a multiple of 4 (so every row's scale stays 4-byte aligned)."""
    return -(-(4 + block_size * width) // 4) * 4


def allocate_latent_fp8_cache(
    num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, device: torch.device | str
) -> torch.Tensor:
    """A zeroed FP8 latent cache: uint8 ``[num_blocks, fp8_row_bytes(block_size, r + rope)]``."""
    _check_int("num_blocks", num_blocks, 2)
    _check_int("block_size", block_size, 1)
    width = _check_int("kv_lora_rank", kv_lora_rank, 1) + _check_int("rope_dim", rope_dim, 0)
    return torch.zeros(
        (num_blocks, fp8_row_bytes(block_size, width)), dtype=torch.uint8, device=device
    )


def fp8_views(rows: torch.Tensor, block_size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales float32 [N], codes float8_e4m3fn [N, block_size, width]) views of FP8 rows."""
    scales = rows[:, :4].view(torch.float32)[:, 0]
    codes = rows[:, 4 : 4 + block_size * width].view(FP8_DTYPE)
    return scales, codes.unflatten(1, (block_size, width))


@dataclass(frozen=True)
class LatentLayout:
    """What a latent cache tensor holds."""

    num_blocks: int
    block_size: int
    rope_dim: int
    fp8: bool  # uint8 rows of [scale | FP8 codes]; else [num_blocks, block_size, r + rope]


def check_latent_cache(
    cache: torch.Tensor, kv_lora_rank: int, rope_dim: int | None = None
) -> LatentLayout:
    """Check either latent layout (``rope_dim``, from the caller's ``k_pe`` / ``q_pe``, is
    needed to read an FP8 cache, whose rows do not show it)."""
    if not isinstance(cache, torch.Tensor):
        raise KernelConfigError(f"latent cache must be a torch.Tensor, got {type(cache).__name__}")
    r = _check_int("kv_lora_rank", kv_lora_rank, 1)
    if cache.dtype == torch.uint8:  # FP8 rows
        if cache.dim() != 2 or not cache.is_contiguous() or rope_dim is None:
            raise KernelConfigError("an FP8 latent cache is a contiguous uint8 [num_blocks, row]")
        width = r + rope_dim
        block_size = (cache.shape[1] - 4) // width
        if block_size < 1 or fp8_row_bytes(block_size, width) != cache.shape[1]:
            raise KernelConfigError(
                f"FP8 latent rows of {cache.shape[1]} bytes do not hold whole blocks of width "
                f"{width} (kv_lora_rank {r} + rope {rope_dim})"
            )
        return LatentLayout(cache.shape[0], block_size, rope_dim, True)
    if cache.dim() != 3:
        raise KernelConfigError(
            "latent cache must be [num_blocks, block_size, kv_lora_rank + rope_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    if cache.dtype not in SUPPORTED_DTYPES:
        raise KernelConfigError(
            f"latent cache dtype must be one of {SUPPORTED_DTYPES} (or uint8 FP8 rows)"
        )
    if cache.stride(-1) != 1:
        raise KernelConfigError("latent cache must have a unit-stride last dimension")
    if r > cache.shape[2]:
        raise KernelConfigError(f"kv_lora_rank {r} exceeds the cache row width {cache.shape[2]}")
    if rope_dim is not None and rope_dim != cache.shape[2] - r:
        raise KernelConfigError(f"rope dim {rope_dim} != the cache's {cache.shape[2] - r}")
    return LatentLayout(cache.shape[0], cache.shape[1], cache.shape[2] - r, False)


def check_store_latent_args(
    c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> LatentLayout:
    """Checks both store backends share; returns the cache's layout."""
    if not isinstance(c_kv, torch.Tensor) or c_kv.dim() != 2:
        raise KernelConfigError("c_kv must be a [num_tokens, kv_lora_rank] tensor")
    if not isinstance(k_pe, torch.Tensor) or k_pe.dim() != 2:
        raise KernelConfigError("k_pe must be a [num_tokens, rope_dim] tensor")
    layout = check_latent_cache(
        cache, c_kv.shape[1], k_pe.shape[1] if cache.dtype == torch.uint8 else None
    )
    if tuple(k_pe.shape) != (c_kv.shape[0], layout.rope_dim):
        raise KernelConfigError(
            f"k_pe must be [{c_kv.shape[0]}, {layout.rope_dim}] (num_tokens, rope)"
        )
    dtype = c_kv.dtype if layout.fp8 else cache.dtype  # FP8: quantized from the model dtype
    for name, t in (("c_kv", c_kv), ("k_pe", k_pe)):
        if t.dtype != dtype or t.dtype not in SUPPORTED_DTYPES or t.device != cache.device:
            raise KernelConfigError(
                f"{name} is {t.dtype} on {t.device}, the cache {cache.dtype} on {cache.device}"
            )
        if t.stride(-1) != 1:
            raise KernelConfigError(f"{name} must have a unit-stride last dimension")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise KernelConfigError("slot_mapping must be an int32 or int64 tensor")
    if slot_mapping.shape != (c_kv.shape[0],) or slot_mapping.device != cache.device:
        raise KernelConfigError(f"slot_mapping must be [{c_kv.shape[0]}] on {cache.device}")
    return layout


def check_mla_args(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> MLAShape:
    """Checks both attention backends share; raises ``KernelConfigError``.

    ``q_nope`` [T, H, nope], ``q_pe`` [T, H, rope], ``w_uk`` [H, nope, r], ``w_uv`` [H, v, r],
    ``out`` [T, H, v] (all in the cache's dtype, or the queries' for an FP8 cache, and on its
    device)."""
    if not isinstance(meta, AttentionMetadata):
        raise KernelConfigError("meta must come from plan_attention")
    if not isinstance(w_uk, torch.Tensor) or w_uk.dim() != 3:
        raise KernelConfigError("w_uk must be a [num_heads, nope_dim, kv_lora_rank] tensor")
    num_heads, nope_dim, r = w_uk.shape
    rope_hint = q_pe.shape[-1] if isinstance(q_pe, torch.Tensor) and q_pe.dim() == 3 else None
    layout = check_latent_cache(cache, r, rope_hint if cache.dtype == torch.uint8 else None)
    num_blocks, block_size, rope_dim = layout.num_blocks, layout.block_size, layout.rope_dim
    dtype = q_nope.dtype if layout.fp8 and isinstance(q_nope, torch.Tensor) else cache.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise KernelConfigError(f"queries must be one of {SUPPORTED_DTYPES}, got {dtype}")
    if not isinstance(w_uv, torch.Tensor) or w_uv.dim() != 3 or w_uv.shape[::2] != (num_heads, r):
        raise KernelConfigError(f"w_uv must be [{num_heads}, v_dim, {r}]")
    v_dim = w_uv.shape[1]
    if block_size != meta.block_size:
        raise KernelConfigError(f"cache block_size {block_size} != planned {meta.block_size}")
    if meta.max_block_id >= num_blocks:
        raise KernelConfigError(
            f"block_table uses block {meta.max_block_id}, the cache has {num_blocks} blocks"
        )
    if cache.device != meta.device:
        raise KernelConfigError(f"the cache is on {cache.device}, meta on {meta.device}")
    tokens = meta.num_tokens
    for name, t, shape in (
        ("q_nope", q_nope, (tokens, num_heads, nope_dim)),
        ("q_pe", q_pe, (tokens, num_heads, rope_dim)),
        ("w_uk", w_uk, None),
        ("w_uv", w_uv, None),
    ):
        if not isinstance(t, torch.Tensor):
            raise KernelConfigError(f"{name} must be a torch.Tensor")
        if shape is not None and tuple(t.shape) != shape:
            raise KernelConfigError(f"{name} must be {list(shape)}, got {list(t.shape)}")
        if t.dtype != dtype or t.device != cache.device:
            raise KernelConfigError(
                f"{name} is {t.dtype} on {t.device}, expected {dtype} on {cache.device}"
            )
        if t.stride(-1) != 1:
            raise KernelConfigError(f"{name} must have a unit-stride last dimension")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise KernelConfigError(f"scale must be a number, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise KernelConfigError(f"scale must be finite and > 0, got {scale}")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (tokens, num_heads, v_dim)
        or out.dtype != dtype
        or out.device != cache.device
    ):
        raise KernelConfigError(f"out must be a [{tokens}, {num_heads}, {v_dim}] tensor")
    return MLAShape(num_heads, r, rope_dim, nope_dim, v_dim, block_size, dtype, layout.fp8)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``[q_nope W_uk | q_pe]``: [T, H, r + rope], the query of the absorbed form."""
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, r]
    return torch.cat((q_lat.transpose(0, 1), q_pe), dim=-1)


def unabsorb_output(lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = W_uv[h] lat[t, h]``: [T, H, r] latent outputs to [T, H, v]."""
    return torch.bmm(lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
