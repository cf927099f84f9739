"""What the engine accepts: checks of its constructor arguments and of each request's inputs.

Every check raises a ``KvCoreError`` subclass before anything is allocated or queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from kvcore_kernels import KernelConfigError
from kvcore_kernels.cache import check_backend

from kvcore.errors import InvalidArgumentError, TooLongError
from kvcore.params import SamplingParams

PromptType = str | Sequence[int]


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def check_engine_args(seed: Any, kernel_backend: Any, device: torch.device) -> None:
    """Constructor arguments checked before the model is loaded."""
    if not _is_int(seed) or seed < 0:
        raise InvalidArgumentError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(kernel_backend, str):
        raise InvalidArgumentError(f"kernel_backend must be a string, got {kernel_backend!r}")
    try:
        check_backend(kernel_backend, device)
    except KernelConfigError as e:
        raise InvalidArgumentError(f"kernel_backend: {e}") from None


def prompt_ids(tokenizer: Any, prompt: Any) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt: a string or a flat sequence of token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer: give prompts as token ids")
        if not prompt:
            raise InvalidArgumentError("empty prompt")
        return prompt, list(tokenizer.encode(prompt))
    if not isinstance(prompt, Sequence | np.ndarray) or isinstance(prompt, bytes):
        raise InvalidArgumentError(
            f"a prompt is a string or a flat sequence of token ids, got {type(prompt).__name__}"
        )
    ids = np.asarray(prompt)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise InvalidArgumentError("a prompt is a string or a flat sequence of token ids")
    return None, ids.tolist()


def check_prompt(
    tokens: list[int],
    p: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    max_num_seqs: int,
    has_tokenizer: bool,
) -> None:
    """One request's prompt and parameters against the model and the engine's limits."""
    if not isinstance(p, SamplingParams):
        raise InvalidArgumentError(f"expected SamplingParams, got {type(p).__name__}")
    if not tokens:
        raise InvalidArgumentError("empty prompt")
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= vocab_size:
        raise InvalidArgumentError(
            f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})"
        )
    if len(tokens) >= max_model_len:
        raise TooLongError(
            f"prompt of {len(tokens)} tokens leaves no room for output "
            f"(max_model_len {max_model_len})"
        )
    if p.n > max_num_seqs:
        raise InvalidArgumentError(f"n = {p.n} exceeds max_num_seqs ({max_num_seqs})")
    if p.stop and not has_tokenizer:
        raise InvalidArgumentError(
            "stop strings need a tokenizer and this model has none: use stop_token_ids"
        )
    bad = [t for t in p.stop_token_ids or [] if t >= vocab_size]
    if bad:
        raise InvalidArgumentError(f"stop_token_ids {bad} are outside the vocabulary")


def broadcast(value: Any, n: int, name: str) -> list[Any]:
    """``value`` for each of ``n`` prompts: a sequence of n, or one value for all."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise InvalidArgumentError(f"{name}: {len(value)} given for {n} prompts")
        return list(value)
    return [value] * n


def priorities(priority: Any, n: int) -> list[int]:
    """One int priority per prompt (0 by default)."""
    prios = broadcast(0 if priority is None else priority, n, "priority")
    if not all(_is_int(x) and -(2**62) <= x < 2**62 for x in prios):
        raise InvalidArgumentError(f"priority must be an int (or one per prompt), got {priority!r}")
    return [int(x) for x in prios]


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the model, as transformers' generate sees them: the generation config's,
    else the model config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None and eos != []:
            return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []
