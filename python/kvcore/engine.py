"""LLMEngine: the step loop that joins the Rust scheduler, the ModelRunner and the sampler.

One ``step()``: ``schedule()`` (one call into Rust) → one forward → one vectorised sampling →
``update(step_id, tokens)`` (one call into Rust) → outputs. Python work per step is one short
loop over the sampled rows (append the token, stamp its time); detokenization runs per token only
for requests that stream or have stop strings, everyone else is decoded once when done.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from kvcore_kernels import KernelConfigError

from kvcore.config import CacheConfig, SchedulerConfig
from kvcore.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    TooLongError,
    UnknownRequestError,
)
from kvcore.model_runner import (
    ModelRunner,
    kivi_residual_bytes,
    kivi_residual_slots,
    kv_bytes_per_block,
)
from kvcore.models import load_model
from kvcore.outputs import RequestOutput, SamplingParams
from kvcore.report import EngineStats
from kvcore.requests import Request, build_scheduler, submit
from kvcore.sampler import Sampler

PromptType = str | Sequence[int]


class LLMEngine:
    """Serves requests on a transformers model over kvcore's paged KV cache."""

    def __init__(
        self,
        model: Any = "smollm2-135m",
        *,
        tokenizer: Any = None,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        kernel_backend: str = "auto",
        enforce_eager: bool = False,
        compile: bool | None = None,
    ):
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.tokenizer = load_model(
            model, tokenizer, dtype=dtype, device=dev, seed=seed
        )
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        if max_model_len is not None and not (isinstance(max_model_len, int) and max_model_len > 1):
            raise InvalidArgumentError(f"max_model_len must be an int > 1, got {max_model_len!r}")
        self.max_model_len = min(max_model_len or limit, limit)
        cc, sc = self.cache_config, self.scheduler_config
        kv_dtype = cc.kv_dtype(self.model.dtype)
        block_size = cc.block_size
        formats = cc.layer_formats(int(config.num_hidden_layers))
        residual_slots = kivi_residual_slots(
            sc.max_num_seqs, sc.max_num_batched_tokens, block_size, cc.kivi_window
        )
        try:
            bytes_per_block = kv_bytes_per_block(config, block_size, kv_dtype, formats)
            reserved = kivi_residual_bytes(config, block_size, kv_dtype, formats, residual_slots)
        except KernelConfigError as e:
            raise InvalidArgumentError(f"kv_format: {e}") from None
        num_blocks = cc.resolve_num_blocks(bytes_per_block, dev, reserved)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.scheduler = build_scheduler(
            num_blocks,
            self.cache_config,
            self.scheduler_config,
            self.max_model_len,
            self.eos_token_ids[0] if self.eos_token_ids else None,
        )
        try:
            self.runner = ModelRunner(
                self.model,
                num_blocks=num_blocks,
                block_size=block_size,
                kv_dtype=kv_dtype,
                kv_formats=formats,
                kv_scale=cc.kv_scale,
                num_residual_blocks=min(residual_slots, num_blocks),
                kivi_window=cc.kivi_window,
                backend=kernel_backend,
                enforce_eager=enforce_eager,
                compile=compile,
                max_num_seqs=sc.max_num_seqs,
                max_model_len=self.max_model_len,
            )
        except KernelConfigError as e:  # e.g. int4 on a head dim that is not a multiple of 32
            raise InvalidArgumentError(f"kv_format {cc.kv_format!r}: {e}") from None
        self.sampler = Sampler(self.vocab_size, dev, seed=seed)
        self.stats = EngineStats(num_blocks=num_blocks, block_size=block_size)
        self._requests: dict[int, Request] = {}  # internal id -> request
        self._ids: dict[str, int] = {}  # user request id -> internal id
        self._next_id = itertools.count()
        self._unscheduled: set[int] = set()  # internal ids not yet in any step

    # ---- admission ----------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("this model has no tokenizer: give prompts as token ids")
            if not prompt:
                raise InvalidArgumentError("empty prompt")
            return prompt, list(self.tokenizer.encode(prompt))
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise InvalidArgumentError("a prompt is a string or a flat sequence of token ids")
        return None, ids.tolist()

    def add_requests(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        priority: Sequence[int] | None = None,
        stream: bool = False,
    ) -> list[str]:
        """Validate and queue a batch of requests (all or none); returns their request ids."""
        n = len(prompts)
        plist = _broadcast(params or SamplingParams(), n, "params")
        ids = [str(r) for r in request_ids] if request_ids is not None else None
        if ids is None:
            ids = [f"req-{next(self._next_id)}" for _ in range(n)]
        if len(ids) != n or len(set(ids)) != n:
            raise InvalidArgumentError("request_ids must be unique, one per prompt")
        if any(i in self._ids for i in ids):
            raise DuplicateRequestError(f"request id already running: {ids}")
        prios = list(priority) if priority is not None else [0] * n
        if len(prios) != n:
            raise InvalidArgumentError(f"priority: {len(prios)} given for {n} prompts")
        built = []
        for rid, prompt, p, prio in zip(ids, prompts, plist, prios, strict=True):
            if not isinstance(p, SamplingParams):
                raise InvalidArgumentError(f"expected SamplingParams, got {type(p)}")
            text, tokens = self._prompt_ids(prompt)
            self._check_prompt(tokens, p)
            built.append((rid, text, tokens, p, prio))
        now = time.perf_counter()
        internal = [next(self._next_id) for _ in built]
        # The scheduler checks each request fits in the cache; it raises before any change.
        submit(
            self.scheduler,
            internal,
            [b[2] for b in built],
            [b[3] for b in built],
            [b[4] for b in built],
            self.eos_token_ids,
        )
        for i, (rid, text, tokens, p, _) in zip(internal, built, strict=True):
            req = Request.create(
                rid, i, text, tokens, p, now, self.sampler, self.tokenizer, stream=stream
            )
            self._requests[i] = req
            self._ids[rid] = i
            self._unscheduled.add(i)
        return ids

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = False,
    ) -> str:
        """Queue one request; returns its request id."""
        ids = [request_id] if request_id is not None else None
        return self.add_requests(
            [prompt], params, request_ids=ids, priority=[priority], stream=stream
        )[0]

    def _check_prompt(self, tokens: list[int], p: SamplingParams) -> None:
        if not tokens:
            raise InvalidArgumentError("empty prompt")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidArgumentError(
                f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(tokens) >= self.max_model_len:
            raise TooLongError(
                f"prompt of {len(tokens)} tokens leaves no room for output "
                f"(max_model_len {self.max_model_len})"
            )
        if p.n > self.scheduler_config.max_num_seqs:
            raise InvalidArgumentError(f"n = {p.n} exceeds max_num_seqs")

    def abort_request(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests (their blocks go back now); returns their final outputs."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        unknown = [r for r in ids if r not in self._ids]
        if unknown:
            raise UnknownRequestError(f"unknown request id(s): {unknown}")
        internal = list(dict.fromkeys(self._ids[r] for r in ids))
        self.scheduler.abort_requests(np.asarray(internal, np.int64))
        now = time.perf_counter()
        outs = []
        for i in internal:
            req = self._requests[i]
            req.finish_all("abort", now)
            outs.append(self._retire(i, now))
        return outs

    # ---- the step loop ------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while some request is queued or running."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running."""
        return len(self._requests)

    def all_blocks_free(self) -> bool:
        """True when every block is back in the pool (free or cached, none referenced)."""
        return int(self.scheduler.stats().num_free_blocks) == self.runner.num_blocks - 1

    def step(self) -> list[RequestOutput]:
        """Run one step; returns outputs of finished requests and of streaming ones that grew."""
        start = time.perf_counter()
        forward_before = self.runner.forward_seconds
        plan = self.scheduler.schedule()
        self.stats.observe_plan(plan, self.scheduler)
        if len(plan.input_ids) == 0:
            self.scheduler.update(plan.step_id, np.zeros(0, np.int64))
            return []
        reqs = self._requests
        if self._unscheduled:  # stamp requests scheduled for the first time
            new = np.intersect1d(plan.req_ids, np.fromiter(self._unscheduled, np.int64))
            for rid in new.tolist():
                reqs[rid].metrics.first_scheduled_time = start
                self._unscheduled.discard(rid)
        logits = self.runner.execute(plan, plan.logits_indices)
        sample_rids = plan.sample_req_ids.tolist()
        sample_idx = plan.sample_seq_index.tolist()
        rows = [reqs[r].samples[i] for r, i in zip(sample_rids, sample_idx, strict=True)]
        slots = np.fromiter((s.slot for s in rows), np.int64, len(rows))
        counts = np.fromiter((len(s.token_ids) for s in rows), np.int64, len(rows))
        out = self.sampler.sample(logits, slots, counts)
        fin = self.scheduler.update(plan.step_id, out.token_ids)
        now = time.perf_counter()
        touched = Request.record(reqs, sample_rids, rows, out, now)
        done = set()  # requests the scheduler no longer holds
        if fin.num_finished:
            for rid, index, reason, tokens in fin.outputs():
                reqs[rid].finish_sample(index, reason, tokens, now)
            done.update(fin.req_ids[fin.request_done].tolist())
            touched.extend(fin.req_ids.tolist())
        # Requests whose every sample has ended, some on a stop string the scheduler cannot
        # see: abort them there so their blocks come back now.
        ended = [i for i in dict.fromkeys(touched) if i not in done and reqs[i].all_finished()]
        if ended:
            self.scheduler.abort_requests(np.asarray(ended, np.int64))
            done.update(ended)
        outputs = [self._retire(i, now) for i in done]
        for i in dict.fromkeys(touched):
            req = reqs.get(i)
            if req is not None and req.stream:
                outputs.append(req.output(finished=False))
        self.stats.observe_step(
            time.perf_counter() - start, self.runner.forward_seconds - forward_before, len(rows)
        )
        return outputs

    def _retire(self, internal_id: int, now: float) -> RequestOutput:
        req = self._requests.pop(internal_id)
        del self._ids[req.request_id]
        self._unscheduled.discard(internal_id)
        req.release(self.sampler)
        req.metrics.finished_time = now
        self.stats.num_finished += 1
        return req.output(finished=True)

    def run(self) -> Iterator[RequestOutput]:
        """Step until every request is done, yielding outputs as they come (streaming form)."""
        while self.has_unfinished_requests():
            yield from self.step()

    def stream(
        self, prompt: PromptType, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Add one streaming request and yield its outputs until it finishes (other requests
        keep being served by the same steps)."""
        rid = self.add_request(prompt, params, stream=True)
        while rid in self._ids:  # until finished here or aborted by someone else
            for out in self.step():
                if out.request_id == rid:
                    yield out


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise InvalidArgumentError(f"{name}: {len(value)} given for {n} prompts")
        return list(value)
    return [value] * n


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids of the model, as transformers' generate sees them: the generation config's,
    else the model config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None and eos != []:
            return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []
