"""LLMEngine: the step loop that joins the Rust scheduler, the ModelRunner and the sampler.

One ``step()``: ``schedule()`` (one call into Rust) → one forward → one vectorised sampling →
``update(step_id, tokens)`` (one call into Rust) → outputs. Python work per step is one short
loop over the sampled rows (append the token, stamp its time); detokenization runs per token only
for requests that stream or have stop strings, everyone else is decoded once when done.

The step loop (``step``, ``run``, ``stream``) is in ``engine_step.py``.

Threads: every public method may be called from any thread. ``add_request(s)`` and
``abort_request`` take a short lock (never held during a forward), so submitters do not wait for
a busy stepper; ``step()`` calls run one at a time. A step that fails aborts the requests it
scheduled (``RequestOutput.error`` says why), closes itself in the scheduler and raises: the
engine keeps serving everyone else.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvcore_kernels import KernelConfigError

from kvcore.config import CacheConfig, SchedulerConfig, resolve_device
from kvcore.engine.inputs import (
    PromptType,
    broadcast,
    check_engine_args,
    check_prompt,
    eos_ids,
    priorities,
    prompt_ids,
)
from kvcore.engine.step_loop import StepLoop
from kvcore.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    UnknownRequestError,
)
from kvcore.retention.h2o import H2OTracker
from kvcore.runner.model_runner import ModelRunner
from kvcore.models.sizes import kivi_residual_bytes, kivi_residual_slots, kv_bytes_per_block
from kvcore.models.loader import load_model
from kvcore.outputs import RequestOutput, SamplingParams
from kvcore.tools.report import EngineStats
from kvcore.engine.request import Request, build_scheduler, salt_namespace, submit
from kvcore.retention.release import (
    RetentionSupport,
    engine_groups,
    exact_release_window,
    kernels_take_null_entries,
)
from kvcore.engine.sampler import Sampler
from kvcore.tiers.build import build_tier_manager, tier_scheduler_args

log = logging.getLogger("kvcore")


class LLMEngine(StepLoop):
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
        for name, value, cls in (
            ("cache_config", self.cache_config, CacheConfig),
            ("scheduler_config", self.scheduler_config, SchedulerConfig),
        ):
            if not isinstance(value, cls):
                raise InvalidArgumentError(f"{name} must be a {cls.__name__}, got {value!r}")
        dev = resolve_device(device)
        check_engine_args(seed, kernel_backend, dev)
        if max_model_len is not None and not (isinstance(max_model_len, int) and max_model_len > 1):
            raise InvalidArgumentError(f"max_model_len must be an int > 1, got {max_model_len!r}")
        self.model, self.tokenizer = load_model(
            model, tokenizer, dtype=dtype, device=dev, seed=seed
        )
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
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
        # Retention (docs/retention.md): policies are checked before anything runs; a hybrid
        # model's KV cache groups make a block hold one group's layers.
        self.retention = RetentionSupport(cc.retention, block_size, formats, config)
        self.h2o = H2OTracker(block_size)
        self.sliding_window = exact_release_window(config, cc.sliding_window_release, formats)
        self.kv_groups = engine_groups(config, cc, formats)
        if self.kv_groups is not None:
            g = self.kv_groups.size
            bytes_per_block = kv_bytes_per_block(config, block_size, kv_dtype, formats[:g])
        num_blocks = cc.resolve_num_blocks(bytes_per_block, dev, reserved)
        self.eos_token_ids = eos_ids(self.model, self.tokenizer)
        tier_args, codec = tier_scheduler_args(cc, sc, self.model, bytes_per_block, formats)
        self.scheduler = build_scheduler(
            num_blocks,
            self.cache_config,
            self.scheduler_config,
            self.max_model_len,
            self.eos_token_ids[0] if self.eos_token_ids else None,
            sliding_window=self.sliding_window,
            group_windows=None if self.kv_groups is None else list(self.kv_groups.windows[1:]),
            **tier_args,
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
                kv_groups=self.kv_groups,
            )
        except KernelConfigError as e:  # e.g. int4 on a head dim that is not a multiple of 32
            raise InvalidArgumentError(f"kv_format {cc.kv_format!r}: {e}") from None
        # Kernels that cannot take null entries get the released ones filled (never read).
        releases = self.sliding_window > 0 or self.kv_groups is not None
        self.runner.fill_released = releases and not kernels_take_null_entries()
        self.tiers = None  # KV tiers (kvcore.tiers): L2 host, L3 disk, L4 Redis
        if codec is not None:
            self.tiers = build_tier_manager(
                cc, self.runner.kv_caches, tier_args["host_blocks"], codec
            )
            self.runner.tier_hook = self.tiers.apply
        self.sampler = Sampler(self.vocab_size, dev, seed=seed)
        self.stats = EngineStats(num_blocks=num_blocks, block_size=block_size)
        self._requests: dict[int, Request] = {}  # internal id -> request
        self._ids: dict[str, int] = {}  # user request id -> internal id
        self._next_id = itertools.count()
        self._unscheduled: set[int] = set()  # internal ids not yet in any step
        # _lock guards the state above, the scheduler and the sampler; it is never held during
        # a forward. _step_lock lets one step run at a time. Order: _step_lock, then _lock.
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._deferred_aborts: collections.deque[str] = collections.deque()

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
        namespaces = [salt_namespace(x) for x in broadcast(cache_salt, n, "cache_salt")]
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
            for i, rid, (text, tokens, p) in zip(internal, ids, built, strict=True):
                req = Request.create(
                    rid, i, text, tokens, p, now, self.sampler, self.tokenizer, stream=stream
                )
                req.sink = _sink
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

    def tier_figures(self) -> dict[str, float]:
        """Per-tier statistics (hit tokens per tier, bytes each way, load latency p50/p95,
        swap-outs/ins); empty without tiers."""
        with self._lock:
            return {} if self.tiers is None else self.tiers.figures(self.scheduler)
