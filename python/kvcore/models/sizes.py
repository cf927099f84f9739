"""KV sizes of any Hugging Face config: its KV geometry and what one block of one layer takes in
any storage format. The one calculator behind the engine's block budget (``kv_bytes_per_block``)
and the capacity planner (``kvcore plan``, ``kvcore eval-kv``: ``kvcore.tools.planner``).

``layer_bytes_per_block(geom, format, block_size, dtype)`` per layer, counted as allocated::

    model dtype ("auto" = dtype, or "float16", ...)  block_size * 2 * kv_heads * head_dim * itemsize
    quantized (fp8_*, int8, int4, int2, kivi*)      block_layout(format, block_size, kv_heads,
                                                    head_dim).block_bytes: codes, scales, zero
                                                    points and row padding
    MLA (kv_lora_rank): one latent of kv_lora_rank + qk_rope_head_dim values per token, no K/V
      model dtype                                   block_size * latent * itemsize
      fp8_e4m3                                      fp8_row_bytes(block_size, latent): codes and
                                                    one float32 scale per block
      other per-token formats                       the latent as one head: half a K+V row (a
                                                    projection; the engine serves the two above)
      KIVI                                          refused

MHA, GQA and MQA differ only in ``kv_heads``. Sliding-window layers hold a block like the others
(one block table for all layers); ``KVGeometry.windows`` says which layers are windowed. KIVI's
model-dtype residual pool is counted apart (``kivi_residual_slots``, ``kivi_residual_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvcore_kernels.mla import fp8_row_bytes
from kvcore_kernels.quant import block_layout
from kvcore_kernels.quant import get_format as get_kv_format

from kvcore.errors import InvalidArgumentError
from kvcore.models.mla import check_mla_config, is_mla_config
from kvcore.models.windows import layer_windows

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVGeometry:
    """What the KV cache of a model depends on, read from its config."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: sliding window, None for full attention
    dtype: torch.dtype  # the config's dtype (float16 when it names none)
    max_position: int
    mla_dim: int | None = None  # MLA: latent width per token (kv_lora_rank + rope dims)
    # MLA: values per layer and token if K and V were cached up-projected per head (MHA form):
    # heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)
    mha_equivalent_dim: int | None = None


def _get(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def _first(cfg: Any, *names: str) -> Any:
    return next((v for n in names if (v := _get(cfg, n)) is not None), None)


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


def _config_dtype(cfg: Any) -> torch.dtype:
    # a transformers config: ``dtype`` (reading ``torch_dtype`` logs a deprecation)
    value = _first(cfg, "torch_dtype", "dtype") if isinstance(cfg, dict) else _get(cfg, "dtype")
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    return DTYPES.get(str(value or "float16"), torch.float16)


def geometry(config: Any) -> KVGeometry:
    """The KV geometry of a config (a dict of its fields or a transformers config; any decoder:
    MHA, GQA, MQA, MLA, windows; GPT-2 / Falcon / ChatGLM field names included)."""
    cfg = config
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    if not isinstance(layers, int) or not isinstance(heads, int) or layers < 1 or heads < 1:
        raise InvalidArgumentError("config needs num_hidden_layers and num_attention_heads")
    kv = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
    if kv is None:
        kv = 1 if _get(cfg, "multi_query") else heads
    head_dim = _get(cfg, "head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not isinstance(head_dim, int) or head_dim < 1 or not isinstance(kv, int) or kv < 1:
        raise InvalidArgumentError("config needs head_dim or hidden_size, and valid KV heads")
    mla = mha_eq = None
    if _get(cfg, "kv_lora_rank"):
        rope = int(_get(cfg, "qk_rope_head_dim") or 0)
        mla = int(_get(cfg, "kv_lora_rank")) + rope
        k_dim = int(_get(cfg, "qk_nope_head_dim") or 0) + rope
        mha_eq = heads * ((k_dim or head_dim) + int(_get(cfg, "v_head_dim") or k_dim or head_dim))
    max_pos = _first(cfg, "max_position_embeddings", "n_positions", "seq_length") or 4096
    windows = _windows(cfg, layers) if isinstance(cfg, dict) else layer_windows(cfg)
    return KVGeometry(
        layers, heads, kv, head_dim, windows, _config_dtype(cfg), int(max_pos), mla, mha_eq
    )


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder config."""
    geom = geometry(config)
    return geom.num_layers, geom.num_kv_heads, geom.head_dim


def layer_bytes_per_block(
    geom: KVGeometry, fmt: str, block_size: int, dtype: torch.dtype | None = None
) -> int:
    """Bytes one block of one layer's KV cache takes in ``fmt`` (a format name, or a dtype name
    such as "float16"), metadata included; ``dtype`` is what "auto" stores (default: the
    config's). The table in the module docstring."""
    f = None if fmt in DTYPES else get_kv_format(fmt)
    if f is None or not f.quantized:  # K and V (or the latent) as the model dtype stores them
        plain = DTYPES[fmt] if f is None else dtype or geom.dtype
        width = geom.mla_dim or 2 * geom.num_kv_heads * geom.head_dim
        return block_size * width * torch.empty((), dtype=plain).element_size()
    if not geom.mla_dim:
        return block_layout(f, block_size, geom.num_kv_heads, geom.head_dim).block_bytes
    if fmt == "fp8_e4m3":  # kvcore's FP8 latent (kvcore_kernels.mla.cache)
        return fp8_row_bytes(block_size, geom.mla_dim)
    if f.kind == "kivi":
        raise InvalidArgumentError(f"{fmt}: KIVI does not apply to MLA latents")
    return block_layout(f, block_size, 1, geom.mla_dim).block_bytes // 2  # one head, K only


def kv_bytes_per_block(
    config: Any, block_size: int, dtype: torch.dtype, formats: list[str] | None = None
) -> int:
    """Bytes one block of KV takes over all layers, as the engine allocates it: ``dtype`` for
    model-dtype layers, the format's block row for quantized ones; an MLA model's latent rows
    (after ``check_mla_config``: the formats the latent cache serves)."""
    if is_mla_config(config):
        check_mla_config(config, formats)
    geom = geometry(config)
    names = formats or ["auto"] * geom.num_layers
    return sum(layer_bytes_per_block(geom, name, block_size, dtype) for name in names)


def mha_equivalent_bytes_per_token(config: Any, dtype: torch.dtype) -> int | None:
    """MLA only: bytes per token (all layers) of the same model caching up-projected K and V per
    head in ``dtype``, ``heads * (qk_nope + qk_rope + v_head_dim)`` values per layer; ``config``
    may be a ``KVGeometry``. None for other models."""
    geom = config if isinstance(config, KVGeometry) else geometry(config)
    if not geom.mla_dim or not geom.mha_equivalent_dim:
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return geom.num_layers * geom.mha_equivalent_dim * itemsize


def kivi_residual_slots(
    max_num_seqs: int, max_num_batched_tokens: int, block_size: int, window: int = 0
) -> int:
    """KIVI residual slots the engine allocates: every block one step can write gets one,
    plus each running sequence's ``window`` recent full blocks.

    A step writes at most ``max_num_batched_tokens`` tokens for at most ``max_num_seqs``
    sequences; each sequence's span touches at most ``ceil(q / bs) + 1`` blocks, so the step
    writes at most ``2 * max_num_seqs + ceil(T / bs)`` blocks (and never more than T).
    Between steps a slot holds a running sequence's partial last block (KIVI's residual).
    """
    per_step = 2 * max_num_seqs + -(-max_num_batched_tokens // block_size)
    return min(max_num_batched_tokens, per_step) + max_num_seqs * window


def kivi_residual_bytes(
    config: Any, block_size: int, dtype: torch.dtype, formats: list[str], slots: int
) -> int:
    """Bytes of KIVI's model-dtype residual pool: ``slots`` blocks in every KIVI layer."""
    geom = geometry(config)
    kivi_layers = sum(get_kv_format(name).kind == "kivi" for name in formats)
    return kivi_layers * slots * layer_bytes_per_block(geom, "auto", block_size, dtype)
