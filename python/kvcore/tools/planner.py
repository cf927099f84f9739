"""Capacity planner: KV bytes per token for any Hugging Face config and storage format, and
how many tokens and concurrent requests a memory budget holds.

Bytes come from the kernels' own block layouts (``kvcore_kernels.quant.block_layout``), so
scales, zero points and padding are counted exactly as allocated. Per layer::

    bytes_per_token(layer) = block_row_bytes(format, block_size, kv_heads, head_dim) / block_size
    model dtype ("auto", "float16", ...): 2 * kv_heads * head_dim * itemsize

MHA, GQA and MQA differ only in ``kv_heads``. MLA (``kv_lora_rank``) caches one latent of
``kv_lora_rank + qk_rope_head_dim`` per token and layer instead of K and V, shown beside its
MHA-equivalent (per-head K and V); ``fp8_e4m3`` is kvcore's FP8 latent (one float32 scale per
block), other per-token formats are applied to it as one head (projections: the engine serves
the model dtype and ``fp8_e4m3``); KIVI does not apply. Sliding-window layers: kvcore shares one
block table across layers, so they hold every token like the others (``bytes_per_token``); the
``requests_windowed`` figure is what an allocator that drops blocks behind the window would fit.
KIVI keeps ``1 + kivi_window`` model-dtype residual blocks per request and layer, counted per
request. The null block (block 0) is subtracted from the budget.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant import bytes_per_token, check_format, get_format, resolve_formats

from kvcore.errors import InvalidArgumentError
from kvcore.models.windows import layer_windows

DEFAULT_FORMATS = ("auto", "float16", "fp8_e4m3", "int8", "int4", "kivi4", "kivi2", "int2")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class Geometry:
    """What the KV cache of a model depends on, read from its config."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: sliding window, None for full attention
    dtype: torch.dtype
    max_position: int
    mla_dim: int | None = None  # MLA: latent width per token (kv_lora_rank + rope dims)
    # MLA: values per layer and token if K and V were cached up-projected per head (MHA form):
    # heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)
    mha_equivalent_dim: int | None = None


@dataclass(frozen=True)
class CapacityRow:
    """One format's line of the capacity table."""

    format: str
    bytes_per_token: float  # all layers, metadata included
    ratio_vs_fp16: float
    max_tokens: int  # tokens the budget holds (whole blocks)
    context_len: int
    max_requests: int  # concurrent requests of context_len tokens
    max_requests_windowed: int  # same, if blocks behind sliding windows were dropped


def parse_memory(text: str | int) -> int:
    """Bytes from ``8GiB`` / ``512MiB`` / ``8G`` (binary) / ``8GB`` (decimal) / ``123``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)(b?)\s*", str(text), re.I
        )
        if m is None:
            raise InvalidArgumentError(f"cannot read a memory size from {text!r} (e.g. 8GiB)")
        num, unit, binary, b = m.groups()
        base = _UNITS[unit.lower()]
        if unit and b and not binary:  # "GB": decimal
            base = 1000 ** "kmgt".index(unit.lower()) * 1000
        number = float(num) * base
        if not math.isfinite(number) or number >= 1 << 62:
            raise InvalidArgumentError(f"memory size {text!r} is too large")
        value = int(number)
    if value <= 0:
        raise InvalidArgumentError(f"memory must be > 0 bytes, got {text!r}")
    return value


def _first(cfg: dict, *names: str) -> Any:
    return next((cfg[n] for n in names if cfg.get(n) is not None), None)


def _windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows as the engine sees them (``windows.layer_windows`` on the config that
    transformers builds from ``cfg``); an architecture transformers does not know gets the
    declared ``sliding_window`` on every layer, or none."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        hf = AutoConfig.for_model(str(cfg.get("model_type")), **fields)
    except (ValueError, TypeError, KeyError):
        hf = None
    except Exception as e:  # transformers' own checks (huggingface_hub strict dataclasses)
        why = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise InvalidArgumentError(f"invalid model config: {why[-1] if why else e!r}") from None
    if hf is not None and getattr(hf, "num_hidden_layers", None) == num_layers:
        return layer_windows(hf)
    window = cfg.get("sliding_window")
    uniform = int(window) if window and cfg.get("use_sliding_window") is not False else None
    return (uniform,) * num_layers


def load_config(config: Any) -> dict:
    """A config as a dict: a path (file or checkpoint folder), a dict or a PretrainedConfig."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except UnicodeDecodeError:
            raise InvalidArgumentError(
                f"cannot read a model config from {path}: not a text (JSON) file"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise InvalidArgumentError(f"cannot read a model config from {path}: {e}") from e
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise InvalidArgumentError("config must be a path, a dict or a transformers config")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type")}
    return config


def geometry(config: Any) -> Geometry:
    """The KV geometry of a Hugging Face config (any decoder: MHA, GQA, MQA, MLA, windows)."""
    cfg = load_config(config)
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    if not isinstance(layers, int) or not isinstance(heads, int) or layers < 1 or heads < 1:
        raise InvalidArgumentError("config needs num_hidden_layers and num_attention_heads")
    kv = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
    if kv is None:
        kv = 1 if cfg.get("multi_query") else heads
    head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int) or head_dim < 1 or not isinstance(kv, int) or kv < 1:
        raise InvalidArgumentError("config needs head_dim or hidden_size, and valid KV heads")
    dtype = DTYPES.get(str(_first(cfg, "torch_dtype", "dtype") or "float16"), torch.float16)
    mla = mha_eq = None
    if cfg.get("kv_lora_rank"):
        mla = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        k_dim = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0)
        mha_eq = heads * ((k_dim or head_dim) + int(cfg.get("v_head_dim") or k_dim or head_dim))
    max_pos = _first(cfg, "max_position_embeddings", "n_positions", "seq_length") or 4096
    return Geometry(
        layers, heads, kv, head_dim, _windows(cfg, layers), dtype, int(max_pos), mla, mha_eq
    )


def mha_equivalent_bytes_per_token(geom: Geometry, fmt: str = "auto") -> float | None:
    """MLA only: bytes per token (all layers) of the same model caching per-head K and V in a
    model-dtype ``fmt`` ("auto", "float16", ...); None for other models or quantized formats."""
    if not geom.mla_dim or not geom.mha_equivalent_dim:
        return None
    dtype = DTYPES.get(fmt, geom.dtype if fmt == "auto" else None)
    if dtype is None:
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return float(geom.num_layers * geom.mha_equivalent_dim * itemsize)


def layer_bytes_per_token(geom: Geometry, fmt: str, block_size: int) -> float:
    """K/V bytes per token of one layer in ``fmt`` ("float16" etc. name a plain dtype)."""
    if fmt in DTYPES:
        width = geom.mla_dim if geom.mla_dim else 2 * geom.num_kv_heads * geom.head_dim
        return width * torch.empty((), dtype=DTYPES[fmt]).element_size()
    f = get_format(fmt)
    if not f.quantized:
        return layer_bytes_per_token(geom, _dtype_name(geom.dtype), block_size)
    if geom.mla_dim:
        if fmt == "fp8_e4m3":  # kvcore's FP8 latent: codes + one float32 scale per block
            from kvcore_kernels.mla_cache import fp8_row_bytes

            return fp8_row_bytes(block_size, geom.mla_dim) / block_size
        if f.kind == "kivi":
            raise InvalidArgumentError(f"{fmt}: KIVI does not apply to MLA latents")
        check_format(f, head_dim=geom.mla_dim, dtype=geom.dtype, block_size=block_size)
        return bytes_per_token(f, 1, geom.mla_dim, block_size, geom.dtype) / 2
    check_format(f, head_dim=geom.head_dim, dtype=geom.dtype, block_size=block_size)
    return bytes_per_token(f, geom.num_kv_heads, geom.head_dim, block_size, geom.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(n for n, d in DTYPES.items() if d == dtype)


def plan_capacity(
    config: Any,
    memory: str | int,
    *,
    formats: Sequence[str | Sequence[str]] = DEFAULT_FORMATS,
    block_size: int = 16,
    context_len: int | None = None,
    kivi_window: int = 0,
) -> tuple[Geometry, list[CapacityRow]]:
    """The capacity table: one row per format (a name, or a per-layer list of names)."""
    geom = geometry(config)
    budget = parse_memory(memory)
    ctx = context_len if context_len is not None else geom.max_position
    if not (isinstance(ctx, int) and ctx >= 1 and isinstance(block_size, int) and block_size >= 1):
        raise InvalidArgumentError("context_len and block_size must be positive integers")
    if not (isinstance(kivi_window, int) and 0 <= kivi_window <= 64):
        raise InvalidArgumentError(
            f"kivi_window must be an int in [0, 64] (blocks), got {kivi_window!r}"
        )
    fp16 = geom.num_layers * layer_bytes_per_token(geom, "float16", block_size)
    rows = []
    for spec in formats:
        try:
            names = resolve_formats(spec, geom.num_layers)
            per_layer = [layer_bytes_per_token(geom, n, block_size) for n in names]
        except KernelConfigError as e:
            raise InvalidArgumentError(str(e)) from e
        label = spec if isinstance(spec, str) else "mixed"
        residual = sum(  # model-dtype residual blocks per request (KIVI layers)
            (1 + kivi_window) * block_size * layer_bytes_per_token(geom, "auto", block_size)
            for n in names
            if n in ("kivi2", "kivi4")
        )
        per_block = block_size * sum(per_layer)
        num_blocks = max(0, int(budget // per_block) - 1)  # minus the null block
        blocks_req = math.ceil(ctx / block_size)
        windowed = sum(
            b * block_size * math.ceil(min(ctx, (w or ctx) + block_size - 1) / block_size)
            for b, w in zip(per_layer, geom.windows, strict=True)
        )
        rows.append(
            CapacityRow(
                format=label,
                bytes_per_token=sum(per_layer),
                ratio_vs_fp16=sum(per_layer) / fp16,
                max_tokens=num_blocks * block_size,
                context_len=ctx,
                max_requests=max(
                    0, int((budget - per_block) // (blocks_req * per_block + residual))
                ),
                max_requests_windowed=max(0, int((budget - per_block) // (windowed + residual))),
            )
        )
    return geom, rows


def format_table(geom: Geometry, rows: list[CapacityRow], budget: int) -> str:
    """The table ``kvcore plan`` prints."""
    kind = (
        "MLA"
        if geom.mla_dim
        else "MQA"
        if geom.num_kv_heads == 1
        else "MHA"
        if geom.num_kv_heads == geom.num_q_heads
        else "GQA"
    )
    windows = sorted({w for w in geom.windows if w})
    shape = (
        f"latent {geom.mla_dim}"
        if geom.mla_dim
        else f"{geom.num_kv_heads} KV heads x {geom.head_dim}"
    )
    lines = [
        f"model: {geom.num_layers} layers, {shape} ({kind}), "
        f"{str(geom.dtype).removeprefix('torch.')}, sliding windows: "
        f"{windows or 'none'} ({sum(w is not None for w in geom.windows)} layers)",
        f"budget: {budget / (1 << 30):.3f} GiB, context per request: {rows[0].context_len} tokens",
        f"{'format':<16}{'bytes/token':>12}{'vs fp16':>9}{'tokens':>14}{'requests':>10}"
        f"{'req(windowed)':>15}",
    ]
    for r in rows:
        lines.append(
            f"{r.format:<16}{r.bytes_per_token:>12.1f}{r.ratio_vs_fp16:>9.3f}{r.max_tokens:>14,}"
            f"{r.max_requests:>10,}{r.max_requests_windowed:>15,}"
        )
    mha = mha_equivalent_bytes_per_token(geom)
    if mha is not None and geom.mla_dim and geom.mha_equivalent_dim:
        latent = geom.num_layers * geom.mla_dim * geom.dtype.itemsize
        lines.append(
            f"MLA latent: {geom.mla_dim} values per layer per token ({latent:,} bytes/token in "
            f"{str(geom.dtype).removeprefix('torch.')}); MHA-equivalent (per-head K and V): "
            f"{geom.mha_equivalent_dim:,} values ({mha:,.0f} bytes/token), "
            f"{mha / latent:.1f}x more"
        )
    return "\n".join(lines)
