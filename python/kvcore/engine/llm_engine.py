"""LLMEngine: the step loop that joins the Rust scheduler, the ModelRunner and the sampler.

One ``step()``: ``schedule()`` (one call into Rust) → one forward → one vectorised sampling →
``update(step_id, tokens)`` (one call into Rust) → outputs. Python work per step is one short
loop over the sampled rows (append the token, stamp its time); detokenization runs per token only
for requests that stream or have stop strings, everyone else is decoded once when done.
Construction (settings → model, sizes, scheduler, runner, tiers) is ``kvcore.engine.builder``.

Threads: every public method may be called from any thread. ``add_request(s)`` and
``abort_request`` take a short lock (never held during a forward), so submitters do not wait for
a busy stepper; ``step()`` calls run one at a time. The forward runs outside the state lock, so
other threads can add and abort requests meanwhile: no block is allocated before the next
``schedule()``, and rows of requests aborted during the forward are neither sampled nor applied
(the scheduler skips them). A step that raises aborts the requests it scheduled (their KV
computed in earlier steps stays cached; ``RequestOutput.error`` says why), closes itself in the
scheduler and re-raises: the engine keeps serving everyone else. A caller that names its own
requests (``step(owner_ids=...)``, as ``LLM.generate`` and ``stream`` do) loses only those: the
step's plan is kept and the next ``step()`` runs it again for the other callers' requests (a
forward is idempotent until ``update()``: it writes the same slots with the same values), so
they finish with their normal outputs. A plan that fails twice with an error (not an
interrupt) aborts everyone in it, so a failure that repeats cannot loop.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvcore._kvcore import kv_snapshot
from kvcore.engine.args import EngineArgs
from kvcore.engine.builder import build
from kvcore.engine.inputs import (
    PromptType,
    broadcast,
    check_prompt,
    priorities,
    prompt_ids,
)
from kvcore.engine.inspect import CacheLedger, build_view
from kvcore.engine.request import Request, salt_namespace, submit
from kvcore.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    KvCoreError,
    StepFailedError,
    UnknownRequestError,
)
from kvcore.outputs import RequestOutput
from kvcore.params import SamplingParams

log = logging.getLogger("kvcore")


class LLMEngine:
    """Serves requests on a model over kvcore's paged KV cache."""

    def __init__(self, args: EngineArgs | Any = None, /, **kwargs: Any):
        """``LLMEngine(EngineArgs(...))``, or the fields as keywords: ``LLMEngine(model, ...)``
        (``kvcore.engine.args.EngineArgs`` lists them; an unknown one is refused)."""
        if not isinstance(args, EngineArgs):
            if args is not None:
                kwargs["model"] = args
            args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            args = EngineArgs.from_kwargs(**{**vars(args), **kwargs})
        self.args = args
        parts = build(args)
        self.cache_config = parts.cache_config
        self.scheduler_config = parts.scheduler_config
        self.model, self.tokenizer = parts.model, parts.tokenizer
        self.vocab_size, self.max_model_len = parts.vocab_size, parts.max_model_len
        self.retention, self.h2o = parts.retention, parts.h2o
        self.sliding_window, self.kv_groups = parts.sliding_window, parts.kv_groups
        self.eos_token_ids = parts.eos_token_ids
        self.scheduler, self.runner, self.tiers = parts.scheduler, parts.runner, parts.tiers
        self.sampler, self.stats = parts.sampler, parts.stats
        codec = getattr(self.tiers, "codec", None)
        self._salt_key: bytes = getattr(codec, "salt_key", None) or os.urandom(32)
        self._requests: dict[int, Request] = {}  # internal id -> request
        self._ids: dict[str, int] = {}  # user request id -> internal id
        self._next_id = itertools.count()
        self._unscheduled: set[int] = set()  # internal ids not yet in any step
        # _lock guards the state above, the scheduler and the sampler; it is never held during
        # a forward. _step_lock lets one step run at a time. Order: _step_lock, then _lock.
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._deferred_aborts: collections.deque[str] = collections.deque()
        # A plan whose forward failed in one caller's step, to run again (under _step_lock).
        self._replay: Any = None
        self._replay_failures = 0
        # What the dashboard names blocks and prefixes by (kvcore.engine.inspect).
        self.ledger = CacheLedger(self.cache_config.block_size)

    # ---- admission ----------------------------------------------------------------------

    def add_requests(
        self,
        prompts: Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        priority: int | Sequence[int] | None = None,
        stream: bool = False,
        cache_salt: str | Sequence[str | None] | None = None,
        retention: str | Sequence[str | None] | None = None,
        _sink: Callable[[RequestOutput], None] | None = None,
    ) -> list[str]:
        """Validate and queue a batch of requests (all or none); returns their request ids.

        ``cache_salt`` (one for all, or one per prompt) is the request's prefix-cache
        namespace: requests with different salts never share a prefix hit (tenant isolation).
        ``retention`` (one for all, or one per prompt; None: the engine's ``retention``) is the
        request's retention policy (``"full"``, ``"window:W"``, ``"sink:S+window:W"``).
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise InvalidArgumentError("prompts must be a list (use add_request for one)")
        n = len(prompts)
        plist = broadcast(params or SamplingParams(), n, "params")
        ids = None if request_ids is None else broadcast(request_ids, n, "request_ids")
        if ids is not None and not all(isinstance(r, str) and r for r in ids):
            raise InvalidArgumentError("request ids must be non-empty strings")
        if ids is not None and len(set(ids)) != n:
            raise InvalidArgumentError("request_ids must be unique, one per prompt")
        prios = priorities(priority, n)
        salts = broadcast(cache_salt, n, "cache_salt")
        namespaces = [salt_namespace(x, self._salt_key) for x in salts]
        policies = self.retention.resolve(retention, n)
        kept = self.retention.blocks(policies)
        built = []
        for prompt, p in zip(prompts, plist, strict=True):
            text, tokens = prompt_ids(self.tokenizer, prompt)
            check_prompt(
                tokens,
                p,
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
                max_num_seqs=self.scheduler_config.max_num_seqs,
                has_tokenizer=self.tokenizer is not None,
            )
            built.append((text, tokens, p))
        with self._lock:
            if ids is None:
                ids = [f"req-{next(self._next_id)}" for _ in range(n)]
            taken = [i for i in ids if i in self._ids]
            if taken:
                raise DuplicateRequestError(f"request id already running: {taken}")
            now = time.perf_counter()
            internal = [next(self._next_id) for _ in built]
            # The scheduler checks each request fits in the cache; it raises before any change.
            submit(
                self.scheduler,
                internal,
                [b[1] for b in built],
                [b[2] for b in built],
                prios,
                self.eos_token_ids,
                namespaces,
                kept,
            )
            for i, pol in zip(internal, policies, strict=True):
                self.h2o.add(i, pol)
            for i, rid, salt, pol, b in zip(internal, ids, salts, policies, built, strict=True):
                self.ledger.admitted(i, rid, salt, pol.kind, b[1])
            for i, rid, (text, tokens, p) in zip(internal, ids, built, strict=True):
                req = Request.create(
                    rid, i, text, tokens, p, now, self.sampler, self.tokenizer, stream=stream
                )
                req.sink = _sink
                self._requests[i] = req
                self._ids[rid] = i
                self._unscheduled.add(i)
        if self.tiers is not None:
            self.tiers.wake()  # a stepper waiting on fetches looks at the new requests now
        return ids

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = False,
        cache_salt: str | None = None,
        retention: str | None = None,
        _sink: Callable[[RequestOutput], None] | None = None,
    ) -> str:
        """Queue one request; returns its request id."""
        if not isinstance(params, SamplingParams | None):
            raise InvalidArgumentError(f"expected SamplingParams, got {type(params).__name__}")
        return self.add_requests(
            [prompt],
            params,
            request_ids=None if request_id is None else [request_id],
            priority=[priority],
            stream=stream,
            cache_salt=[cache_salt],
            retention=[retention],
            _sink=_sink,
        )[0]

    def abort_request(self, request_id: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests (their blocks go back now); returns their final outputs.

        ``UnknownRequestError`` if any id is not queued or running (then none is aborted)."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        if not isinstance(ids, Sequence) or not all(isinstance(r, str) for r in ids):
            raise InvalidArgumentError(
                f"request_id must be a request id string or a list of them, got {request_id!r}"
            )
        with self._lock:
            unknown = [r for r in ids if r not in self._ids]
            if unknown:
                raise UnknownRequestError(f"unknown request id(s): {unknown}")
            return self._abort_locked(list(dict.fromkeys(self._ids[r] for r in ids)))

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stops the tiers' background I/O, waiting at most ``timeout_s`` for their writes;
        True if everything finished. Never blocks longer, whatever a tier does."""
        return True if self.tiers is None else self.tiers.close(timeout_s)

    def tier_figures(self) -> dict[str, float]:
        """Per-tier statistics (hit tokens per tier, bytes each way, load latency p50/p95,
        swap-outs/ins); empty without tiers."""
        with self._lock:
            return {} if self.tiers is None else self.tiers.figures(self.scheduler)

    def inspect(self) -> dict[str, Any]:
        """A read-only picture of the KV cache for the dashboard (``kvcore.engine.inspect``):
        one Rust snapshot under the state lock, the view built outside it."""
        with self._lock:
            raw = kv_snapshot(self.scheduler)
            facts = self.ledger.copy_for(raw["req_ids"])
        raw["block_size"] = self.cache_config.block_size
        return build_view(raw, facts, self.tokenizer)

    # ---- the step loop ------------------------------------------------------------------

    def _abort_locked(self, internal: list[int], error: str | None = None) -> list[RequestOutput]:
        self._note_peaks(self.scheduler.abort_requests(np.asarray(internal, np.int64)))
        now = time.perf_counter()
        for i in internal:
            self._requests[i].finish_all("abort", now)
            self._requests[i].error = error
        return [self._retire(i, now) for i in internal]

    def _note_peaks(self, fin: Any) -> None:
        """Each finished sample's peak KV blocks into its request (``peak_kv_blocks``)."""
        if not fin.num_finished:
            return
        for rid, peak in zip(fin.req_ids.tolist(), fin.peak_blocks.tolist(), strict=True):
            req = self._requests.get(rid)
            if req is not None:
                req.peak_kv_blocks = max(req.peak_kv_blocks, int(peak))

    def _abort_later(self, request_id: str) -> None:
        """Abort ``request_id`` if it is still running: now when the engine is free, else at
        the start of the next step (safe from a finalizer, whatever thread or lock it runs in)."""
        if self._lock.acquire(blocking=False):
            try:
                if request_id in self._ids:
                    self._abort_locked([self._ids[request_id]])
            finally:
                self._lock.release()
        else:
            self._deferred_aborts.append(request_id)

    def _drain_deferred_aborts(self) -> None:
        while self._deferred_aborts:
            rid = self._deferred_aborts.popleft()
            if rid in self._ids:
                self._abort_locked([self._ids[rid]])

    def has_unfinished_requests(self) -> bool:
        """True while some request is queued or running."""
        with self._lock:
            return bool(self._requests) or bool(self._deferred_aborts)

    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running."""
        with self._lock:
            return len(self._requests)

    def all_blocks_free(self) -> bool:
        """True when every block is back in the pool (free or cached, none referenced)."""
        with self._lock:
            return int(self.scheduler.stats().num_free_blocks) == self.runner.num_blocks - 1

    def step(self, *, owner_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Run one step; returns outputs of finished requests and of streaming ones that grew.

        Steps run one at a time (a second thread calling ``step`` waits for the first). If the
        step fails (an exception in the forward, in sampling or in the bookkeeping after
        ``schedule()``; Ctrl-C), the requests it had scheduled are aborted with
        ``RequestOutput.error`` set, every block comes back, and the error is raised
        (``StepFailedError``; ``KeyboardInterrupt`` as it is): the engine goes on serving the
        other requests. ``owner_ids``: the caller's own request ids; then a
        failure aborts only those, and the step's other requests run again in the next step
        (once more for an error, always for an interrupt) with unchanged outputs."""
        with self._step_lock:
            return self._step(owner_ids)

    def _step(self, owner_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        start = time.perf_counter()
        forward_before = self.runner.forward_seconds
        failed: BaseException | None = None
        with self._lock:
            self._drain_deferred_aborts()
            plan = self._replay
            if plan is not None and not any(i in self._requests for i in plan.req_ids.tolist()):
                self._close_replay()  # everyone in the failed step left meanwhile
                plan = None
            if plan is None:
                if self.tiers is not None:  # fetched blocks into L2 before admission looks
                    self.tiers.before_schedule(self.scheduler, self.runner.forward_seconds)
                plan = self.scheduler.schedule()
            # From schedule() on, a failure must close the step (below), or every later
            # schedule() would be refused while this one stays outstanding.
            try:
                if plan is not self._replay:
                    self.stats.observe_plan(plan, self.scheduler)
                    if len(plan.input_ids) and self._unscheduled:
                        self._stamp_new(plan, start)
                    if len(plan.input_ids) == 0:
                        if self.tiers is not None:
                            self.tiers.apply(plan)  # moves and fetches of a step with no forward
                        self.scheduler.update(plan.step_id, np.zeros(0, np.int64))
                        plan = None
                mass = None if plan is None else self.h2o.mass_tensor(plan, self.runner.device)
            except BaseException as exc:  # noqa: BLE001 - handled after the lock is released
                failed = exc
        if failed is not None:
            self._fail_step(plan, failed, owner_ids)
            raise failed
        if plan is None:  # nothing to run: wait (lock released) for a fetch to move
            if self.tiers is not None and self.tiers.num_fetching:
                self.tiers.wait_fetch()
            return []
        try:
            # Outside the lock: other threads may add or abort requests during the forward
            # (no block is allocated before the next schedule(); aborted rows are skipped).
            logits = self.runner.execute(plan, plan.logits_indices, block_mass=mass)
            with self._lock:
                outputs, num_rows = self._finish_step(plan, logits, mass)
                self._replay, self._replay_failures = None, 0
        except BaseException as exc:
            self._fail_step(plan, exc, owner_ids)
            raise
        self.stats.observe_step(
            time.perf_counter() - start, self.runner.forward_seconds - forward_before, num_rows
        )
        return outputs

    def _close_replay(self) -> None:
        plan, self._replay, self._replay_failures = self._replay, None, 0
        if plan is not None and self.scheduler.outstanding_step == plan.step_id:
            self.scheduler.update(plan.step_id, np.zeros(len(plan.sample_req_ids), np.int64))

    def _stamp_new(self, plan: Any, start: float) -> None:
        """Requests scheduled for the first time: queue time and prefix-cache hit length."""
        reqs = self._requests
        first = np.isin(plan.req_ids, np.fromiter(self._unscheduled, np.int64))
        starts = np.asarray(plan.query_start_loc)[:-1][first]
        # A new request's first computed position is its prefix-cache hit length.
        hits = np.asarray(plan.positions)[starts].tolist()
        for rid, hit in zip(plan.req_ids[first].tolist(), hits, strict=True):
            if rid in self._unscheduled:
                reqs[rid].metrics.first_scheduled_time = start
                reqs[rid].num_cached_tokens = int(hit)
                self.ledger.first_scheduled(rid, int(hit), reqs[rid].prompt_token_ids, start)
                self._unscheduled.discard(rid)

    def _finish_step(
        self, plan: Any, logits: torch.Tensor, mass: torch.Tensor | None = None
    ) -> tuple[list[RequestOutput], int]:
        reqs = self._requests
        sample_rids = plan.sample_req_ids.tolist()
        sample_idx = plan.sample_seq_index.tolist()
        # Rows of requests aborted during the forward are not sampled (their sampler slots
        # may already serve someone else); the scheduler ignores their tokens.
        live = [k for k, r in enumerate(sample_rids) if r in reqs]
        if len(live) < len(sample_rids):
            logits = logits[torch.as_tensor(live, dtype=torch.long, device=logits.device)]
            sample_rids = [sample_rids[k] for k in live]
            sample_idx = [sample_idx[k] for k in live]
        rows = [reqs[r].samples[i] for r, i in zip(sample_rids, sample_idx, strict=True)]
        slots = np.fromiter((s.slot for s in rows), np.int64, len(rows))
        counts = np.fromiter((len(s.token_ids) for s in rows), np.int64, len(rows))
        out = self.sampler.sample(logits, slots, counts)
        tokens = out.token_ids
        if len(live) < len(plan.sample_req_ids):
            tokens = np.zeros(len(plan.sample_req_ids), np.int64)
            tokens[live] = out.token_ids
        drops = self.h2o.drops(plan, mass)  # H2O: blocks to give up (kvcore.retention.h2o)
        fin = self.scheduler.update(plan.step_id, tokens, drop_blocks=drops if len(drops) else None)
        now = time.perf_counter()
        touched = Request.record(reqs, sample_rids, rows, out, now)
        done = set()  # requests the scheduler no longer holds
        if fin.num_finished:
            self._note_peaks(fin)
            for rid, index, reason, toks in fin.outputs():
                reqs[rid].finish_sample(index, reason, toks, now)
            done.update(fin.req_ids[fin.request_done].tolist())
            touched.extend(fin.req_ids.tolist())
        # Requests whose every sample has ended, some on a stop string the scheduler cannot
        # see: abort them there so their blocks come back now.
        ended = [i for i in dict.fromkeys(touched) if i not in done and reqs[i].all_finished()]
        if ended:
            self._note_peaks(self.scheduler.abort_requests(np.asarray(ended, np.int64)))
            done.update(ended)
        outputs = [self._retire(i, now) for i in done]
        for i in dict.fromkeys(touched):
            req = reqs.get(i)
            if req is not None and req.stream:
                outputs.append(req.output(finished=False))
                if req.sink is not None:
                    req.sink(outputs[-1])
        return outputs, len(rows)

    def _fail_step(self, plan: Any, exc: BaseException, owner_ids: Any = None) -> None:
        """Abort the failed step's requests (only the caller's when it named them, the others
        then run again in the next step) and close the step, so the engine keeps serving."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        reason = "interrupted" if interrupted else repr(exc)
        message = f"step {plan.step_id} failed: {reason}"
        with self._lock:
            victims = [i for i in dict.fromkeys(plan.req_ids.tolist()) if i in self._requests]
            outstanding = self.scheduler.outstanding_step == plan.step_id
            if outstanding and owner_ids is not None:
                mine = [self._ids[r] for r in dict.fromkeys(owner_ids) if r in self._ids]
                if mine:
                    self._abort_locked(mine, message)
                victims = [i for i in victims if i in self._requests]
                self._replay_failures += 0 if interrupted else 1
                if victims and self._replay_failures < 2:
                    self._replay = plan
                    log.warning(
                        "kvcore: %s; the caller's %d request(s) were aborted, %d other(s) run "
                        "again",
                        message,
                        len(mine),
                        len(victims),
                    )
                    if not isinstance(exc, KvCoreError) and isinstance(exc, Exception):
                        raise StepFailedError(message) from exc
                    return
            self._replay, self._replay_failures = None, 0
            if outstanding:
                self._abort_locked(victims, message)
                self.scheduler.update(plan.step_id, np.zeros(len(plan.sample_req_ids), np.int64))
            else:  # it failed after update(): some victims may be finished in the scheduler
                for i in victims:
                    try:
                        self._abort_locked([i], message)
                    except UnknownRequestError:
                        now = time.perf_counter()
                        self._requests[i].finish_all("abort", now)
                        self._requests[i].error = message
                        self._retire(i, now)
        log.warning("kvcore: %s; its %d request(s) were aborted", message, len(victims))
        if not isinstance(exc, KvCoreError) and isinstance(exc, Exception):
            raise StepFailedError(message) from exc

    def _retire(self, internal_id: int, now: float) -> RequestOutput:
        req = self._requests.pop(internal_id)
        self.h2o.forget(internal_id)
        self.ledger.retired(internal_id)
        del self._ids[req.request_id]
        self._unscheduled.discard(internal_id)
        req.release(self.sampler)
        req.metrics.finished_time = now
        self.stats.num_finished += 1
        out = req.output(finished=True)
        if req.sink is not None:
            req.sink(out)  # under the lock: the output is there before anyone sees it gone
        return out

    def run(self) -> Iterator[RequestOutput]:
        """Step until every request is done, yielding outputs as they come (streaming form)."""
        while self.has_unfinished_requests():
            yield from self.step()

    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> Iterator[RequestOutput]:
        """Add one streaming request and yield its outputs until it finishes (other requests
        keep being served by the same steps). Closing the iterator early (``close()``,
        ``break`` then garbage collection) aborts the request and frees its blocks.
        ``kwargs``: ``request_id``, ``priority``, ``cache_salt`` as in ``add_request``."""
        queue: collections.deque[RequestOutput] = collections.deque()
        rid = self.add_request(prompt, params, stream=True, _sink=queue.append, **kwargs)
        finished = False
        try:
            while not finished:
                if queue:
                    out = queue.popleft()
                    finished = out.finished
                    yield out
                elif rid in self._ids:
                    self.step(owner_ids=[rid])
                else:
                    return  # ended without a final output (cannot happen; never spin)
        finally:
            if not finished:
                self._abort_later(rid)
