"""Capacity planner: KV bytes per token for any Hugging Face config and storage format, and
how many tokens and concurrent requests a memory budget holds.

Bytes come from ``kvcore.models.sizes`` (``layer_bytes_per_block``, the engine's own block
sizes, built on the kernels' block layouts), so scales, zero points and padding are counted
exactly as allocated. Per layer::

    bytes_per_token(layer) = layer_bytes_per_block(geometry, format, block_size) / block_size
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

from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant import check_format, get_format, resolve_formats

from kvcore.errors import InvalidArgumentError
from kvcore.models import sizes
from kvcore.models.sizes import DTYPES, KVGeometry, layer_bytes_per_block

DEFAULT_FORMATS = ("auto", "float16", "fp8_e4m3", "int8", "int4", "kivi4", "kivi2", "int2")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


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


def geometry(config: Any) -> KVGeometry:
    """The KV geometry of a Hugging Face config (a path, a dict or a transformers config; any
    decoder: MHA, GQA, MQA, MLA, windows)."""
    return sizes.geometry(load_config(config))


def mha_equivalent_bytes_per_token(geom: KVGeometry, fmt: str = "auto") -> float | None:
    """MLA only: bytes per token (all layers) of the same model caching per-head K and V in a
    model-dtype ``fmt`` ("auto", "float16", ...); None for other models or quantized formats."""
    dtype = DTYPES.get(fmt, geom.dtype if fmt == "auto" else None)
    mha = sizes.mha_equivalent_bytes_per_token(geom, dtype) if dtype is not None else None
    return None if mha is None else float(mha)


def layer_bytes_per_token(geom: KVGeometry, fmt: str, block_size: int) -> float:
    """K/V bytes per token of one layer in ``fmt`` ("float16" etc. name a plain dtype), after
    checking that the kernels can pack ``fmt`` for this geometry."""
    f = None if fmt in DTYPES else get_format(fmt)
    latent_own = geom.mla_dim and f is not None and (fmt == "fp8_e4m3" or f.kind == "kivi")
    if f is not None and f.quantized and not latent_own:  # FP8 latent: its own rows; KIVI: refused
        head_dim = geom.mla_dim or geom.head_dim
        check_format(f, head_dim=head_dim, dtype=geom.dtype, block_size=block_size)
    size = layer_bytes_per_block(geom, fmt, block_size)
    # a model-dtype layer's bytes per token are a whole number: kept an int in the tables
    return size / block_size if f is not None and f.quantized else size // block_size


def plan_capacity(
    config: Any,
    memory: str | int,
    *,
    formats: Sequence[str | Sequence[str]] = DEFAULT_FORMATS,
    block_size: int = 16,
    context_len: int | None = None,
    kivi_window: int = 0,
) -> tuple[KVGeometry, list[CapacityRow]]:
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
            (1 + kivi_window) * layer_bytes_per_block(geom, "auto", block_size)
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


def format_table(geom: KVGeometry, rows: list[CapacityRow], budget: int) -> str:
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
