"""The front-end's half of a request: token deltas from the engine process in, cumulative
``RequestOutput`` snapshots out (the same ones the in-process engine makes).

Text is made here, not in the engine: an ``IncrementalDetokenizer`` per sample for requests that
stream or have stop strings (the engine's own rule), one ``decode`` at the end for the others
(so a non-streaming text equals ``LLM.generate``'s). A stop string ends its sample here; once
every sample ended, the caller aborts the request in the engine and the final output goes out
at once. Tokens that arrive after a sample ended are dropped, as the engine drops them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine.core_messages import RequestDelta
from kvcore.engine.detokenizer import IncrementalDetokenizer
from kvcore.engine.request import completion_outputs
from kvcore.outputs import RequestMetrics, RequestOutput
from kvcore.params import SamplingParams


@dataclass(slots=True)
class _Sample:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    detok: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None


class TrackedRequest:
    """One request as the front-end sees it, from submit to the engine's final delta."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        stream: bool,
        sink: Any,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.stream = stream
        self.sink = sink  # where outputs go (the stream's queue, on its event loop)
        self.metrics = RequestMetrics(time.perf_counter())
        self.num_cached_tokens = 0
        self.accepted = False
        self.delivered_final = False  # the stream got its final output (stop string, error)
        self.closed = False  # the consumer left: nothing more is delivered
        needs_text = (stream or bool(params.stop)) and params.detokenize and tokenizer is not None
        self.samples = [_Sample(i) for i in range(params.n)]
        for s in self.samples:
            if params.logprobs is not None:
                s.logprobs = []
                s.top_logprobs = [] if params.logprobs > 0 else None
            if needs_text:
                s.detok = IncrementalDetokenizer(
                    tokenizer,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=list(params.stop or []),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )

    def engine_params(self) -> SamplingParams:
        """The params the engine gets: no stop strings, no text."""
        p = self.params
        if not p.stop and not p.detokenize:
            return p
        kw = {f: getattr(p, f) for f in p.__dataclass_fields__}
        kw.update(stop=[], detokenize=False, include_stop_str_in_output=False)
        return SamplingParams(**kw)

    @property
    def engine_stream(self) -> bool:
        """Whether the engine sends a delta every step (streaming or stop strings)."""
        return self.stream or any(s.detok is not None for s in self.samples)

    def apply(self, d: RequestDelta, now: float) -> bool:
        """Add one step's delta; returns True when it ended every sample here (stop strings):
        the engine must be told to abort the request."""
        m = self.metrics
        if d.first_scheduled_time is not None and m.first_scheduled_time is None:
            m.first_scheduled_time = d.first_scheduled_time
            self.num_cached_tokens = d.num_cached_tokens
        for s, new in zip(self.samples, d.token_ids, strict=False):
            if s.finish_reason is not None or not new:
                continue
            k = s.index
            if s.index == 0:
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.extend([now] * len(new))
            if s.logprobs is not None and d.logprobs is not None:
                s.logprobs.extend(d.logprobs[k])
                if s.top_logprobs is not None and d.top_logprobs is not None:
                    s.top_logprobs.extend(d.top_logprobs[k])
            if s.detok is None:
                s.token_ids.extend(new)
                continue
            for tok in new:  # a stop string may end it inside the delta
                s.token_ids.append(tok)
                s.detok.push([tok])
                if s.detok.stopped_by is not None:
                    s.finish_reason, s.stop_reason = "stop", s.detok.stopped_by
                    if s.logprobs is not None:
                        cut = len(s.token_ids)
                        del s.logprobs[cut:]
                        if s.top_logprobs is not None:
                            del s.top_logprobs[cut:]
                    break
        if d.finished:
            for s, reason, stop in zip(
                self.samples, d.finish_reasons or [], d.stop_reasons or [], strict=False
            ):
                if s.finish_reason is None:
                    s.finish_reason, s.stop_reason = reason, stop
            for s in self.samples:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
            if d.token_times and not self.delivered_final:  # the engine's own, exact
                m.token_times = list(d.token_times)
                m.first_token_time = d.token_times[0]
            if m.finished_time is None:
                m.finished_time = now
            return False
        if all(s.finish_reason is not None for s in self.samples):
            m.finished_time = now
            return True
        return False

    def finish_on_error(self, now: float) -> None:
        """An engine that failed or died: every sample ends as aborted."""
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        if self.metrics.finished_time is None:
            self.metrics.finished_time = now

    def output(self, finished: bool, error: str | None = None) -> RequestOutput:
        """A cumulative snapshot, as ``Request.output`` makes it in the engine."""
        outs = completion_outputs(self.samples, finished, self.tokenizer, self.params)
        return RequestOutput(
            self.request_id,
            None,
            self.prompt_token_ids,
            outs,
            finished,
            self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=error,
        )
