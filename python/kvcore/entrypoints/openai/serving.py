"""From a validated OpenAI request to engine inputs, and the engine's streams back to responses.

``prepare_*`` turn a request into prompts (token ids) and ``SamplingParams``, checking what needs
the model (context length, chat template, n limit) so a bad request is a 400 before anything is
queued. ``run`` submits every prompt to the AsyncEngine and merges their streams; ``collect`` and
``sse`` shape the result as one JSON body or as server-sent events (responses.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestStream
from kvcore.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
)
from kvcore.errors import KvCoreError
from kvcore.outputs import RequestOutput
from kvcore.params import SamplingParams


@dataclass
class ServerState:
    """Everything the handlers need, built once at start-up."""

    engine: AsyncEngine  # or EngineCoreClient (the engine process), same interface
    tokenizer: Any  # the front end's own copy (the engine thread uses the engine's)
    model_name: str
    max_model_len: int
    vocab_size: int
    max_n: int
    api_key: str | None = None
    max_waiting: int | None = None
    max_body_bytes: int = 1 << 20
    metrics: Any = None
    draining: bool = False
    shutdown_cut: bool = False  # the grace period ended: what still runs was aborted
    # prompts admitted whose submits have not returned yet (they count as waiting: bursts of
    # requests are admitted before any of their submits has run)
    reserved: int = 0
    model_dtype: str = ""


@dataclass
class Job:
    """One HTTP request's engine work: its prompts, sampling params and outputs."""

    id: str
    kind: str  # "completion" | "chat"
    created: int
    prompts: list[list[int]]
    params: list[SamplingParams]
    req: Any
    start: float = field(default_factory=time.perf_counter)
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> last
    streams: list[RequestStream] = field(default_factory=list)

    def close(self) -> None:
        """Abort whatever of this job still runs (idempotent; a no-op once all finished)."""
        for s in self.streams:
            s.close()


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise ApiError(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


def _encode(state: ServerState, text: str) -> list[int]:
    if state.tokenizer is None:
        raise ApiError(
            400, "This model has no tokenizer: give the prompt as token ids.", param="prompt"
        )
    return list(state.tokenizer.encode(text))


def _params(
    state: ServerState, req: Any, prompt_len: int, max_tokens: int | None
) -> SamplingParams:
    limit = state.max_model_len
    if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
        asked = f"{prompt_len + (max_tokens or 0)} tokens ({prompt_len} in the prompt"
        asked += f", {max_tokens} in the completion)" if max_tokens else ")"
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{asked}. Please reduce the length of the prompt or completion.",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if req.n > state.max_n:
        raise ApiError(400, f"n must be at most {state.max_n}, got {req.n}.", param="n")
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    try:
        return SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            max_tokens=max_tokens or (limit - prompt_len),
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )
    except KvCoreError as e:
        raise ApiError(400, str(e)) from None


def prepare_completion(state: ServerState, req: CompletionRequest) -> Job:
    """Prompts and params of a /v1/completions request (400/404 on a bad one)."""
    _check_model(state, req.model)
    check_unsupported(req)
    p = req.prompt
    if isinstance(p, str):
        prompts = [_encode(state, p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [_encode(state, x) for x in p]  # type: ignore[arg-type]
    else:
        prompts = [list(x) for x in p]  # type: ignore[arg-type,union-attr]
    if not prompts or any(not x for x in prompts):
        raise ApiError(400, "The prompt must not be empty.", param="prompt")
    explicit = "max_tokens" in req.model_fields_set  # null: up to the context length
    limit = state.max_model_len
    params = [  # OpenAI's default of 16 is clamped to the room the prompt leaves
        _params(state, req, len(x), req.max_tokens if explicit else max(1, min(16, limit - len(x))))
        for x in prompts
    ]
    return Job(f"cmpl-{uuid.uuid4().hex}", "completion", int(time.time()), prompts, params, req)


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> Job:
    """Prompt (chat template applied) and params of a /v1/chat/completions request."""
    _check_model(state, req.model)
    check_unsupported(req)
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ApiError(400, "This model has no chat template: use /v1/completions.")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in req.messages
    ]
    try:
        ids = tok.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=req.add_generation_prompt,
            return_dict=False,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise ApiError(400, f"Could not apply the chat template: {e}", param="messages") from None
    prompt = [int(t) for t in ids]
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = [_params(state, req, len(prompt), max_tokens)]
    return Job(f"chatcmpl-{uuid.uuid4().hex}", "chat", int(time.time()), [prompt], params, req)


def _admit(state: ServerState, num_prompts: int = 1) -> None:
    """Refuse a body while draining, or when its prompts (each counts) would take the waiting
    requests past ``--max-waiting`` (503; 400 when the body alone has more prompts)."""
    if state.draining:
        raise ApiError(
            503, "The server is shutting down.", type="server_error", headers={"Retry-After": "5"}
        )
    cap = state.max_waiting
    if cap is not None and num_prompts > cap:
        raise ApiError(
            400,
            f"The request has {num_prompts} prompts; this server queues at most {cap} "
            "(--max-waiting): split it.",
            param="prompt",
        )
    waiting = state.engine.num_waiting + state.reserved
    if cap is not None and waiting + num_prompts > cap:
        raise ApiError(
            503,
            f"The server is overloaded ({waiting} requests waiting): retry later.",
            type="server_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )


async def run(state: ServerState, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Submit the job's prompts, all at once (they enter the engine in the same step); returns
    an iterator of (prompt index, output) once all are accepted (so engine-side rejections
    still become an HTTP error before any byte is sent). If one is refused or the caller is
    cancelled (the client left), every prompt of the job is aborted."""
    _admit(state, len(job.prompts))
    single = len(job.prompts) == 1
    # Each prompt counts in ``state.reserved`` until its submit starts; from then on the
    # engine's ``num_waiting`` counts it (counting both would refuse bodies that fit).
    unstarted = [len(job.prompts)]

    async def submit(i: int, prompt: list[int], params: SamplingParams) -> RequestStream:
        unstarted[0] -= 1
        state.reserved -= 1
        return await state.engine.submit(
            job.id if single else f"{job.id}-{i}",
            prompt,
            params,
            priority=job.req.priority,
            cache_salt=job.req.cache_salt,
            stream=job.req.stream,
        )

    tasks = [
        asyncio.ensure_future(submit(i, prompt, params))
        for i, (prompt, params) in enumerate(zip(job.prompts, job.params, strict=True))
    ]
    state.reserved += len(tasks)
    try:
        await asyncio.wait(tasks)
    except BaseException:  # cancelled: each pending submit aborts its own request
        for t in tasks:
            t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                t.result().close()
        raise
    finally:
        state.reserved -= unstarted[0]  # tasks cancelled before they started
    errors = [t.exception() for t in tasks if t.exception() is not None]
    job.streams.extend(t.result() for t in tasks if t.exception() is None)
    if errors:
        job.close()  # release the prompts already queued
        e = errors[0]
        if isinstance(e, KvCoreError):
            raise ApiError(400, str(e)) from None
        if isinstance(e, EngineError):
            raise engine_api_error(e) from None
        raise
    return _merge(job, job.streams)


def engine_api_error(e: EngineError) -> ApiError:
    """503 once the engine process is gone (the server is exiting), 500 for a failed step."""
    if isinstance(e, EngineDeadError):
        return ApiError(503, str(e), type="server_error", code="engine_dead")
    return ApiError(500, str(e), type="server_error")


async def _merge(job: Job, streams: list[RequestStream]):
    if len(streams) == 1:
        async for out in streams[0]:
            if out.finished:
                job.finals[0] = out
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await merged.put((i, out))
            await merged.put((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await merged.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                if item.finished:
                    job.finals[i] = item
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        job.close()


def observe_overhead(state: ServerState, job: Job) -> None:
    """Record the server's own time for this request: wall time in the handler minus the
    engine's time (arrival in the engine to finish) of its slowest prompt."""
    if state.metrics is None or len(job.finals) != len(job.prompts):
        return
    engine_s = max(
        (o.metrics.finished_time or 0.0) - o.metrics.arrival_time for o in job.finals.values()
    )
    state.metrics.overhead.observe(max(0.0, time.perf_counter() - job.start - engine_s))
