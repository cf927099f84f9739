"""MLA geometry: which configs kvcore serves on a latent cache, their latent dimensions, the
features the latent path refuses, and the tiny DeepSeek model of the tests and benchmarks.

A DeepSeek-V2/V3 layer caches one latent per token, ``[c_kv | k_pe]`` of ``kv_lora_rank +
qk_rope_head_dim`` values, instead of per-head K and V. Its bytes per block are computed with
every other layout's by ``kvcore.models.sizes``; the attention module that reads and writes the
latent cache is ``kvcore.runner.mla``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.errors import InvalidArgumentError

MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
# RoPE variants whose frequencies depend on the longest position of the forward's batch: with
# every request packed into one row they would differ from a request run alone.
_SEQ_DEPENDENT_ROPE = ("dynamic", "longrope")
LATENT_FORMATS = ("auto", "float32", "float16", "bfloat16", "fp8_e4m3")


def is_mla_config(config: Any) -> bool:
    """Whether ``config`` describes a DeepSeek-style MLA model kvcore serves on a latent cache."""
    return getattr(config, "model_type", None) in MLA_MODEL_TYPES and bool(
        getattr(config, "kv_lora_rank", None)
    )


def latent_dims(config: Any) -> tuple[int, int, int]:
    """(num_layers, kv_lora_rank, qk_rope_head_dim) of an MLA config."""
    return config.num_hidden_layers, int(config.kv_lora_rank), int(config.qk_rope_head_dim)


def check_mla_config(config: Any, kv_formats: list[str] | None = None) -> None:
    """Raise ``InvalidArgumentError`` naming the first feature the latent path does not serve."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in _SEQ_DEPENDENT_ROPE:
        raise InvalidArgumentError(
            f"MLA model: rope_type {rope_type!r} is not supported by kvcore (its frequencies "
            "depend on the batch's longest sequence; supported: default, linear, yarn, ...)"
        )
    if int(config.qk_rope_head_dim) % 2:
        raise InvalidArgumentError("MLA model: an odd qk_rope_head_dim is not supported")
    for name in kv_formats or []:
        if name not in LATENT_FORMATS:
            raise InvalidArgumentError(
                f"MLA model: kv_format {name!r} is not supported on the latent cache "
                f"(supported: {', '.join(LATENT_FORMATS)}; fp8_e4m3 = FP8 with a per-block scale)"
            )


# The benchmark's DeepSeek-V3-shaped random model: MLA with MoE layers, small enough for a CPU.
# Cache per token and layer: 128 + 32 = 160 values; MHA-equivalent 8 * (64 + 32 + 64) = 1,280.
TINY_DEEPSEEK_CONFIG: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    moe_intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
)


def tiny_deepseek(
    version: str = "v3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """A DeepSeek-V2 or -V3 causal LM with seeded random weights (any config field overridable;
    V3 gets ``n_group=topk_group=1`` unless given: group-limited routing over one group)."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    fields = {**TINY_DEEPSEEK_CONFIG, **overrides}
    fields["num_key_value_heads"] = fields["num_attention_heads"]
    if version == "v3":
        fields = {"n_group": 1, "topk_group": 1, **fields}
        config = DeepseekV3Config(
            **fields, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2
        )
    elif version == "v2":
        config = DeepseekV2Config(
            **fields, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2
        )
    else:
        raise InvalidArgumentError(f"version must be 'v2' or 'v3', got {version!r}")
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(rng_state)
    return model.to(dtype).eval()
