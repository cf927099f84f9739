"""SamplingParams: how to sample a request's completion(s), shaped like vLLM's.

Validated when built: bad values raise ``InvalidArgumentError`` before anything is scheduled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcore.errors import InvalidArgumentError

MAX_LOGPROBS = 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgumentError(message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: Integers go to the engine process as 64-bit values (msgpack): larger ones are refused here.
_I64 = 2**63


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). ``temperature=0`` is greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # same seed -> same output, whatever else is in the batch
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: chosen tokens; k: chosen + top k
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        _check(
            _is_int(self.n) and 1 <= self.n < _I64,
            f"n must be an integer in [1, 2**63), got {self.n!r}",
        )
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and -2.0 <= value <= 2.0,
                f"{name} must be in [-2, 2], got {value!r}",
            )
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            _is_int(self.top_k) and -1 <= self.top_k < _I64,
            f"top_k must be an integer in [-1, 2**63), got {self.top_k!r}",
        )
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        _check(
            _is_int(self.max_tokens) and 1 <= self.max_tokens < _I64,
            f"max_tokens must be an integer in [1, 2**63), got {self.max_tokens!r}",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and -_I64 <= self.seed < 2 * _I64),
            f"seed must be an int in [-2**63, 2**64), got {self.seed!r}",
        )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            self.stop is None or isinstance(self.stop, list | tuple),
            f"stop must be a string or a list of strings, got {self.stop!r}",
        )
        self.stop = list(self.stop or [])
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty str"
        )
        _check(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple),
            f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(
            all(_is_int(t) and 0 <= t < _I64 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers below 2**63",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        flags = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize")
        for name in flags:
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool")
        _check(not (self.stop and not self.detokenize), "stop strings need detokenize=True")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty applies."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
