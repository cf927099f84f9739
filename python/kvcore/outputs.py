"""User-facing results, shaped like vLLM's: ``RequestOutput`` carries the prompt, one
``CompletionOutput`` per sample (``n``), and ``RequestMetrics`` (queue time, time to first
token, inter-token latencies). The request's input side is ``kvcore.params.SamplingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
