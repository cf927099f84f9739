"""LLM: the offline, vLLM-shaped entry point (``generate`` and ``chat``) over an LLMEngine."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from kvcore.engine.args import EngineArgs
from kvcore.engine.llm_engine import LLMEngine
from kvcore.errors import InvalidArgumentError, InvariantError, KvCoreError, StepFailedError
from kvcore.outputs import RequestOutput
from kvcore.params import SamplingParams


def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] | {"prompt"/"prompt_token_ids"} -> list."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        prompts = [prompts]  # one prompt given as token ids
    if not isinstance(prompts, Sequence):
        raise InvalidArgumentError(f"prompts must be a string or a list, not {type(prompts)}")
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise InvalidArgumentError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        else:
            out.append(p)
    return out


class LLM:
    """Offline inference on a transformers model with kvcore's paged KV cache.

    ``model`` is ``"smollm2-135m"`` (the embedded default), ``"tiny-llama"``, a local checkpoint
    directory or a loaded ``PreTrainedModel``. Every other setting is a field of ``EngineArgs``
    (declared once there, with the CLI flags derived from it).
    """

    def __init__(self, model: Any = "smollm2-135m", **kwargs: Any):
        """``kwargs``: the fields of ``kvcore.engine.args.EngineArgs`` (block_size, kv_format,
        max_num_seqs, dtype, device, ...; or ``cache_config`` / ``scheduler_config`` objects).
        An unknown name is refused with ``InvalidArgumentError``."""
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An ``LLM`` over an engine already built (e.g. by ``kvcore.engine.factory``)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self) -> Any:
        """The tokenizer (None for a model given without one)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """``SamplingParams`` from the model's ``generation_config`` (temperature, top-p,
        top-k, min-p, repetition penalty), then ``overrides`` (as vLLM's method of this name)."""
        from kvcore.engine.generation_defaults import default_sampling_params

        return default_sampling_params(self.engine.model, **overrides)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        retention: str | Sequence[str | None] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in prompt order. ``retention``: one policy for all
        or one per prompt (None: the engine's ``retention``; see docs/retention.md).
        ``cache_salt``: one for all or one per prompt (None: the shared namespace); prompts
        with different salts never share a prefix-cache or tier hit (tenant isolation).

        Safe to call from several threads at once on one ``LLM``: their requests share the
        engine's steps and each call returns its own outputs. If the call is interrupted
        (Ctrl-C) or a step fails, its unfinished requests are aborted before the error
        propagates, so the engine is ready for the next call."""
        plist = _normalize_prompts(prompts)
        if not plist:
            return []
        # Final outputs arrive from whichever thread runs the step that ends them.
        arrivals: collections.deque[RequestOutput] = collections.deque()
        results: dict[str, RequestOutput] = {}

        def sink(out: RequestOutput) -> None:
            if out.finished:
                arrivals.append(out)

        ids = self.engine.add_requests(
            plist,
            sampling_params,
            priority=priority,
            retention=retention,
            cache_salt=cache_salt,
            _sink=sink,
        )
        try:
            self._run(ids, arrivals, results, use_tqdm)
        except BaseException:
            while arrivals:
                out = arrivals.popleft()
                results[out.request_id] = out
            alive = [r for r in ids if r not in results]
            if alive:
                try:
                    self.engine.abort_request(alive)
                except KvCoreError:  # some finished meanwhile: abort the rest one by one
                    for r in alive:
                        if r not in results:
                            with contextlib.suppress(KvCoreError):
                                self.engine.abort_request(r)
            raise
        failed = [results[r] for r in ids if results[r].error is not None]
        if failed:
            raise StepFailedError(
                f"{len(failed)} of {len(ids)} requests were aborted by a failed step: "
                f"{failed[0].error}"
            )
        return [results[r] for r in ids]

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Complete one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered with the tokenizer's chat template."""
        tok = self.get_tokenizer()
        if tok is None:
            raise InvalidArgumentError("chat needs a tokenizer with a chat template")
        if not messages:
            raise InvalidArgumentError("chat needs at least one message")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            list(
                tok.apply_chat_template(
                    conv,
                    tokenize=True,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    return_dict=False,
                )
            )
            for conv in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self,
        ids: list[str],
        arrivals: collections.deque[RequestOutput],
        results: dict[str, RequestOutput],
        use_tqdm: bool,
    ) -> None:
        engine = self.engine
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        start, num_out = time.perf_counter(), 0
        try:
            while len(results) < len(ids):
                if not arrivals and not engine.has_unfinished_requests():
                    # A sink runs before its request leaves the engine: this cannot happen.
                    missing = [r for r in ids if r not in results]
                    raise InvariantError(f"requests left the engine without output: {missing}")
                if not arrivals:
                    engine.step(owner_ids=ids)  # waits while another thread's step runs
                new = 0
                while arrivals:
                    out = arrivals.popleft()
                    results[out.request_id] = out
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    new += 1
                if bar is not None and new:
                    rate = num_out / max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                    bar.update(new)
        finally:
            if bar is not None:
                bar.close()
