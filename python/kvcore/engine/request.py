"""The engine's per-request state and the seam to the Rust scheduler.

The scheduler owns tokens, blocks and finish rules (max_tokens, EOS, stop token ids); Python keeps
what only Python can do per request: sampler slots, detokenizers for stop strings and streaming,
logprobs and timings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcore import _kvcore
from kvcore.config import CacheConfig, SchedulerConfig
from kvcore.engine.detokenizer import IncrementalDetokenizer
from kvcore.engine.sampler import Sampler, SamplerOutput
from kvcore.errors import InvalidArgumentError
from kvcore.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvcore.params import SamplingParams


def build_scheduler(
    num_blocks: int,
    cache: CacheConfig,
    sched: SchedulerConfig,
    max_model_len: int,
    eos_token_id: int | None,
    sliding_window: int = 0,
    group_windows: list[int] | None = None,
    **tier_args: Any,
) -> Any:
    """The Rust scheduler for this engine's cache and limits (``tier_args``: see
    ``kvcore.tiers.build``)."""
    return _kvcore.Scheduler(
        num_blocks=num_blocks,
        block_size=cache.block_size,
        prefix_mode="hash_sha256"
        if cache.prefix_caching == "hash" and cache.prefix_hash == "sha256"
        else cache.prefix_caching,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        max_model_len=max_model_len,
        policy=sched.policy,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        watermark=sched.watermark,
        eos_token_id=eos_token_id,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        sliding_window=sliding_window,
        group_windows=group_windows,
        **tier_args,
    )


def submit(
    scheduler: Any,
    internal_ids: list[int],
    prompts: list[list[int]],
    params: list[SamplingParams],
    priorities: list[int],
    eos_ids: list[int],
    namespaces: list[int] | None = None,
    retention: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Add a batch of requests to the scheduler in one call (finish rules included);
    ``retention``: per request (sink blocks, window blocks) of a lossy policy, 0 for full."""
    stops = []
    for p in params:
        ids = list(p.stop_token_ids or [])
        if not p.ignore_eos:  # EOS ids beyond the scheduler's one stop like stop tokens
            ids += [e for e in eos_ids[1:] if e not in ids]
        stops.append(ids)
    scheduler.add_requests(
        np.asarray(internal_ids, np.int64),
        np.fromiter((t for pr in prompts for t in pr), np.int64),
        np.cumsum([0] + [len(pr) for pr in prompts], dtype=np.int64),
        np.asarray([p.max_tokens for p in params], np.int64),
        priorities=np.asarray(priorities, np.int64),
        namespaces=np.asarray(namespaces or [0] * len(params), np.int64),
        n=np.asarray([p.n for p in params], np.int64),
        ignore_eos=[p.ignore_eos for p in params],
        stop_token_ids=np.fromiter((t for st in stops for t in st), np.int64),
        stop_offsets=np.cumsum([0] + [len(st) for st in stops], dtype=np.int64),
        retention_sink=None if retention is None else retention[0],
        retention_window=None if retention is None else retention[1],
    )


def salt_namespace(cache_salt: str | None, key: bytes = b"") -> int:
    """The prefix cache namespace of a ``cache_salt`` (0, the shared one, for None): a digest
    keyed by the engine's salt key (``key``: from the tier secret, or random per engine without
    shared tiers), so requests with different salts never share a prefix hit (vLLM's
    ``cache_salt``) and no one without the key can compute the namespace of a salt."""
    if cache_salt is None:
        return 0
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidArgumentError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    digest = hashlib.blake2b(
        cache_salt.encode(), digest_size=8, key=key, person=b"kvcore-salt"
    ).digest()
    return (int.from_bytes(digest, "little") & ((1 << 63) - 1)) or 1  # non-zero, fits int64


def _reason(reason: Any) -> str:
    return reason if isinstance(reason, str) else str(getattr(reason, "name", reason)).lower()


def sample_text(s: Any, finished: bool, tokenizer: Any, params: SamplingParams) -> str:
    """A sample's text: streamed (its detokenizer's), or decoded once when it finishes."""
    if s.detok is not None:
        return s.detok.text
    if not finished or tokenizer is None or not params.detokenize:
        return ""
    if s.text is None:
        s.text = tokenizer.decode(s.token_ids, skip_special_tokens=params.skip_special_tokens)
    return s.text


def completion_outputs(
    samples: list[Any], finished: bool, tokenizer: Any, params: SamplingParams
) -> list[CompletionOutput]:
    """Cumulative ``CompletionOutput`` snapshots of a request's samples (each has ``index``,
    ``token_ids``, ``finish_reason``, ``stop_reason``, ``logprobs``, ``top_logprobs``, ``detok``
    and ``text``): the engine's ``Request`` and the front-end's ``TrackedRequest`` share it."""
    outs = []
    for s in samples:
        lp = s.logprobs
        outs.append(
            CompletionOutput(
                index=s.index,
                text=sample_text(s, finished, tokenizer, params),
                token_ids=list(s.token_ids),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                cumulative_logprob=float(np.sum(lp)) if lp is not None else None,
                logprobs=list(lp) if lp is not None else None,
                top_logprobs=list(s.top_logprobs) if s.top_logprobs is not None else None,
            )
        )
    return outs


@dataclass(slots=True)
class Sample:
    """One completion being produced."""

    index: int
    slot: int  # sampler slot
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    detok: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None


@dataclass(slots=True)
class Request:
    """Python-side state of one request."""

    request_id: str
    internal_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sample]
    metrics: RequestMetrics
    tokenizer: Any
    stream: bool = False
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    peak_kv_blocks: int = 0  # most KV blocks one of its samples held at once
    # Called with each output the engine produces for this request (LLM.generate, stream())
    sink: Callable[[RequestOutput], None] | None = None
    error: str | None = None  # set when a failed step aborted the request

    @classmethod
    def create(
        cls,
        request_id: str,
        internal_id: int,
        prompt: str | None,
        tokens: list[int],
        p: SamplingParams,
        now: float,
        sampler: Sampler,
        tokenizer: Any,
        stream: bool = False,
    ) -> Request:
        """State for a new request: sampler slots and, where needed, detokenizers."""
        needs_text = (stream or bool(p.stop)) and p.detokenize and tokenizer is not None
        samples = []
        for i in range(p.n):
            s = Sample(index=i, slot=sampler.add(p, tokens, index=i))
            if p.logprobs is not None:
                s.logprobs = []
                s.top_logprobs = [] if p.logprobs > 0 else None
            if needs_text:
                s.detok = IncrementalDetokenizer(
                    tokenizer,
                    skip_special_tokens=p.skip_special_tokens,
                    stop=list(p.stop or []),
                    include_stop_str_in_output=p.include_stop_str_in_output,
                )
            samples.append(s)
        return cls(
            request_id,
            internal_id,
            prompt,
            tokens,
            p,
            samples,
            RequestMetrics(now),
            tokenizer,
            stream,
        )

    @staticmethod
    def record(
        reqs: dict[int, Request],
        req_ids: list[int],
        rows: list[Sample],
        out: SamplerOutput,
        now: float,
    ) -> list[int]:
        """Append each row's sampled token; returns ids of requests needing attention (streaming
        or a stop string matched)."""
        touched: dict[int, None] = {}
        tokens = out.token_ids.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else None
        for k, s in enumerate(rows):
            if s.finish_reason is not None:
                continue  # ended on a stop string; the scheduler has not let go yet
            tok = tokens[k]
            s.token_ids.append(tok)
            rid = req_ids[k]
            req = reqs[rid]
            if s.index == 0:
                m = req.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.append(now)
            if s.logprobs is not None and lps is not None:
                s.logprobs.append(lps[k])
                if (
                    s.top_logprobs is not None
                    and out.top_ids is not None
                    and out.top_logprobs is not None
                ):
                    kk = req.params.logprobs or 0
                    ids, vals = out.top_ids[k, :kk].tolist(), out.top_logprobs[k, :kk].tolist()
                    s.top_logprobs.append(dict(zip(ids, vals, strict=True)))
            if s.detok is not None:
                s.detok.push([tok])
                if s.detok.stopped_by is not None:
                    s.finish_reason, s.stop_reason = "stop", s.detok.stopped_by
                touched[rid] = None
            elif req.stream:
                touched[rid] = None
        return list(touched)

    def all_finished(self) -> bool:
        """True when every sample has a finish reason."""
        return all(s.finish_reason is not None for s in self.samples)

    def finish_sample(self, index: int, reason: Any, output: list[int], now: float) -> None:
        """The scheduler finished sample ``index`` (``output``: its authoritative tokens)."""
        s = self.samples[index]
        if s.finish_reason is not None:
            return  # already ended on a stop string
        s.token_ids = list(output)
        s.finish_reason = _reason(reason)
        if s.finish_reason == "stop" and s.token_ids:
            s.stop_reason = s.token_ids[-1]

    def finish_all(self, reason: str, now: float) -> None:
        """Give every unfinished sample ``reason`` (abort)."""
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = reason

    def release(self, sampler: Sampler) -> None:
        """Give the sampler slots back."""
        for s in self.samples:
            sampler.remove(s.slot)

    def output(self, finished: bool) -> RequestOutput:
        """A RequestOutput snapshot (cumulative tokens and text)."""
        outs = completion_outputs(self.samples, finished, self.tokenizer, self.params)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            finished,
            self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            peak_kv_blocks=self.peak_kv_blocks,
            error=self.error,
        )
