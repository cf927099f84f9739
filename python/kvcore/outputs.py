"""User-facing request types, shaped like vLLM's: SamplingParams in, RequestOutput out.

``SamplingParams`` is validated when built: bad values raise ``InvalidArgumentError`` before
anything is scheduled. ``RequestOutput`` carries the prompt, one ``CompletionOutput`` per sample
(``n``), and ``RequestMetrics`` (queue time, time to first token, inter-token latencies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvcore.errors import InvalidArgumentError

MAX_LOGPROBS = 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgumentError(message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
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
        _check(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be >= -1, got {self.top_k!r}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(self.seed is None or _is_int(self.seed), f"seed must be an int, got {self.seed!r}")
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
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
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


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter()`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token arrived

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to first being scheduled."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive output tokens (of the first sample)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sampled completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None  # logprob of each chosen token
    top_logprobs: list[dict[int, float]] | None = None  # with SamplingParams.logprobs = k > 0

    @property
    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything about one request: its prompt, completions and timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Most KV blocks one of its samples held at once (retention bounds it; set when finished)
    peak_kv_blocks: int = 0
    # Why the request ended early when not by its own rules: a failed step aborted it
    error: str | None = None
