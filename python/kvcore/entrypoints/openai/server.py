"""``kvcore serve``: the FastAPI app (OpenAI's endpoints, /health, /metrics) and its runner.

Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 bad
parameter or prompt too long, 401 missing or wrong key (``hmac.compare_digest``), 404 unknown
model or route, 413 body over ``--max-body-bytes``, 503 + ``Retry-After`` over ``--max-waiting``
waiting requests or while shutting down, 500 when the engine fails. SIGINT/SIGTERM stop admitting
(503), let in-flight requests finish for ``--shutdown-grace-s`` seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import logging
import signal
import sys
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvcore.engine.async_engine import AsyncEngine, EngineError
from kvcore.engine.core_proc import engine_info
from kvcore.entrypoints.openai import dashboard, responses, serving
from kvcore.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from kvcore.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from kvcore.entrypoints.openai.serving import ServerState

log = logging.getLogger("kvcore.scaleout")
http_log = logging.getLogger("kvcore.http")


#: Seconds an idle keep-alive connection stays open. Longer than clients keep idle pooled
#: connections (aiohttp 15 s, httpx 5 s), so the client closes first: with uvicorn's 5 s, a
#: request sent on a pooled connection as the server closed it failed with "Server disconnected"
#: (1 of 864 requests of `vllm bench serve` at 1-4 req/s, 2026-12-02).
KEEP_ALIVE_S = 30


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), state.api_key.encode()
    )
    if not ok:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


async def read_body(state: ServerState, request: Request) -> bytes:
    """The request body, refused (413) past the byte cap without reading it all."""
    cap = state.max_body_bytes
    too_big = ApiError(413, f"The request body is larger than {cap} bytes.", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:  # the client left mid-body: one line, no traceback
        raise ApiError(400, "The client disconnected before sending the whole body.") from None
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(state: ServerState, request: Request, job: serving.Job) -> Response:
    # Watch for the client leaving from the start: a body of many prompts is dropped as a
    # whole (every prompt aborted) even while its prompts are being submitted.
    gone = asyncio.ensure_future(_until_disconnect(request))
    submit = asyncio.ensure_future(serving.run(state, job))
    try:
        await asyncio.wait({submit, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        gone.cancel()
        submit.cancel()
        job.close()
        raise
    if not submit.done():  # the client left while its prompts were being submitted
        submit.cancel()
        with contextlib.suppress(BaseException):
            await submit
        job.close()
        return Response(status_code=499)
    if job.req.stream:
        gone.cancel()  # the streaming response watches for disconnects itself
        outputs = submit.result()
        return StreamingResponse(
            responses.sse(state, job, outputs),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(job.close),  # runs even if the client left early
        )
    try:
        outputs = submit.result()
    except BaseException:
        gone.cancel()
        raise
    work = asyncio.ensure_future(responses.collect(state, job, outputs))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left: drop the work (its requests get aborted)
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
        job.close()
    if work.cancelled():
        return Response(status_code=499)
    return JSONResponse(work.result())


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a running AsyncEngine."""
    app = FastAPI(title="kvcore", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvcore = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        # One line per client error, never a traceback.
        level = logging.WARNING if e.status >= 500 or "disconnected" in e.message else logging.INFO
        http_log.log(
            level, "%s %s -> %d: %s", request.method, request.url.path, e.status, e.message
        )
        return _error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return _error(ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError) -> JSONResponse:
        return _error(serving.engine_api_error(e))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(ApiError(500, f"Internal error: {type(e).__name__}", type="server_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.engine.running and not state.draining
        dead = getattr(state.engine, "dead", None)
        status = "ok" if ok else (dead or ("draining" if state.draining else "engine stopped"))
        body = {"status": status, **state.engine.snapshot}
        if getattr(state.engine, "proc", None) is not None:  # the engine-core process
            body["engine_pid"] = state.engine.proc.pid
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Rendered off the event loop: the dashboard's series may ask the engine process for a
        # picture (one utility call answered on this loop).
        dash = getattr(state, "dashboard", None)
        if dash is not None:
            dash.loop = asyncio.get_running_loop()
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(state, request)
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvcore",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(state, request)
        req = parse_body(CompletionRequest, await read_body(state, request))
        return await _complete(state, request, serving.prepare_completion(state, req))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(state, request)
        req = parse_body(ChatCompletionRequest, await read_body(state, request))
        return await _complete(state, request, serving.prepare_chat(state, req))

    if getattr(state, "dashboard", None) is not None:  # entrypoints/openai/dashboard.py
        dashboard.mount(app, state, state.dashboard)
    return app


def _state(engine: Any, info: dict[str, Any], args: Any) -> ServerState:
    """The server's state over an engine handle (in-process or the engine process) and the
    engine's ``engine_info``."""
    name = args.served_model_name or str(args.model)
    cache_info = {
        "block_size": info["block_size"],
        "num_gpu_blocks": info["num_blocks"],
        "cache_dtype": info["kv_format"],  # as asked (vLLM's label: "auto" = the model's)
        "kv_dtype": info["kv_dtype"] if not info["quantized"] else "quantized",
        "model_dtype": info["model_dtype"],
        "enable_prefix_caching": str(info["prefix_caching"] != "off"),
        "prefix_caching": info["prefix_caching"],
    }
    metrics = ServerMetrics(name, args.metrics_prefix, cache_info)
    engine.metrics = metrics
    if getattr(engine, "snapshot", None):
        metrics.observe_snapshot(engine.snapshot)
    tokenizer = info["tokenizer"]
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=name,
        max_model_len=info["max_model_len"],
        vocab_size=info["vocab_size"],
        max_n=min(args.max_n, info["max_num_seqs"]),
        api_key=args.api_key,
        max_waiting=args.max_waiting if args.max_waiting > 0 else None,
        max_body_bytes=args.max_body_bytes,
        metrics=metrics,
        model_dtype=info["model_dtype"],
    )
    if getattr(args, "dashboard", True):  # --no-dashboard turns /dashboard off
        state.dashboard = dashboard.Dashboard(state)  # type: ignore[attr-defined]
    return state


def make_state(engine: Any, args: Any) -> ServerState:
    """The server's state over an ``LLMEngine`` built in this process (``AsyncEngine``: a
    thread steps the engine; ``--engine-in-process``)."""
    info = engine_info(engine)
    if info["tokenizer"] is not None:  # the handlers' own copy (the engine thread uses its)
        info["tokenizer"] = copy.deepcopy(info["tokenizer"])
    return _state(AsyncEngine(engine), info, args)


def start_state(make_engine: Any, args: Any) -> ServerState:
    """The server's state over an engine-core process that runs ``make_engine(args)``
    (``kvcore.engine.core_proc``; ``make_engine`` must be importable by name)."""
    from kvcore.engine.core_client import EngineCoreClient

    client = EngineCoreClient(make_engine, args)
    return _state(client, client.info, args)


def run_server(state: ServerState, host: str, port: int, grace_s: float, log_level: str) -> int:
    """Serve until SIGINT/SIGTERM; returns 0 after a graceful shutdown, 1 if the engine
    process died (its open requests got 503s or in-band errors first)."""
    import uvicorn

    cut_after = max(0.0, grace_s - min(1.0, grace_s / 2))

    def cut() -> None:
        # Before uvicorn cancels the handlers at the end of the grace period: abort what still
        # runs, so each open stream ends with an error event and [DONE] (responses.sse), not
        # with a cancelled task.
        state.shutdown_cut = True
        state.engine.cut("the server is shutting down")

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop admitting at once; uvicorn then waits up to grace_s for in-flight requests.
            # Unlike uvicorn's own handler, the signal is not re-raised afterwards: exit 0.
            if not state.draining:
                timer = threading.Timer(cut_after, cut)
                timer.daemon = True
                timer.start()
            state.draining = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(
        build_app(state),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(grace_s)),
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="off",
    )
    server = _Server(config)

    def on_dead(why: str) -> None:  # the engine process died: fail fast, exit non-zero
        state.draining = True
        threading.Timer(0.5, setattr, (server, "should_exit", True)).start()  # errors first

    if hasattr(state.engine, "on_dead"):
        state.engine.on_dead = on_dead
        if state.engine.dead:
            on_dead(state.engine.dead)
    try:
        server.run()
    finally:
        state.engine.stop(timeout=5.0)
        # The tiers' writes get a short deadline: a hung disk or store never holds the exit
        # (their threads are daemons; the engine process closes its own the same way).
        inner = getattr(state.engine, "engine", None)
        if inner is not None:
            with contextlib.suppress(Exception):
                inner.close(timeout_s=2.0)
    if getattr(state.engine, "dead", None):
        print(f"kvcore serve: {state.engine.dead}", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1
