"""Tiny sliding-window models with seeded random weights, shaped like the real families.

``tiny_window_model(name)`` builds one of ``TINY_WINDOW_MODELS``: small enough for CPU tests,
with the same attention features as the family (no tokenizer; prompts are token ids):

==============  ==================================================================================
tiny-mistral    every layer windowed (``sliding_window`` 32)
tiny-qwen2      Qwen2 with ``use_sliding_window``: layers 3..5 windowed (``max_window_layers`` 3)
tiny-qwen3      Qwen3 (q/k norms, head_dim 64): layers 2..5 windowed (``max_window_layers`` 2)
tiny-gemma2     Gemma 2: alternating local/global, attention and final logit soft-capping
tiny-gemma3     Gemma 3: 5 local : 1 global, one KV head, q/k norms, ``query_pre_attn_scalar``,
                local RoPE theta 10k and global 1M (the 270M release's layout, scaled down)
==============  ==================================================================================

All share hidden 256, 6 layers, 4 query heads, 2 KV heads (Gemma 3: 1), vocab 32000, window 32;
any field can be overridden (the tests shrink them further).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcore.errors import InvalidArgumentError

TINY_WINDOW = 32
_BASE: dict[str, Any] = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=32000,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
# name -> (transformers config class, causal LM class, fields beyond _BASE)
TINY_WINDOW_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "tiny-mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=TINY_WINDOW)),
    "tiny-qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=3),
    ),
    "tiny-qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=64, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=2),
    ),
    "tiny-gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=TINY_WINDOW,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "tiny-gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=TINY_WINDOW
        ),
    ),
}


def tiny_window_model(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """The tiny model ``name`` with weights drawn from ``seed`` (the global RNG is left alone)."""
    import transformers

    if name not in TINY_WINDOW_MODELS:
        raise InvalidArgumentError(
            f"unknown tiny model {name!r}: one of {', '.join(TINY_WINDOW_MODELS)}"
        )
    config_cls, model_cls, fields = TINY_WINDOW_MODELS[name]
    config = getattr(transformers, config_cls)(**{**_BASE, **fields, **overrides})
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
    finally:
        torch.random.set_rng_state(rng_state)
    return model.to(dtype).eval()
