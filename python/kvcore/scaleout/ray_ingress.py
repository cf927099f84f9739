"""The OpenAI ingress of ``kvcore serve --replicas``: a FastAPI app on Ray Serve.

It validates a request exactly as ``kvcore serve`` does (``serving.prepare_*``: 400/401/404/413
before any replica works), sends the body and the first prompt's token ids (``RoutedRequest``)
through the engine deployment's handle (the request router reads the ids) and relays the
replica's status and body, or its server-sent events. With disaggregated prefill it first has a
prefill replica write the prompt's KV to the shared tier. A replica that dies mid-request gives
503 + ``Retry-After: 1`` (``code: replica_failed``), or an in-band error event once a stream's
headers are sent. ``/metrics`` and ``/health`` read what the replicas push to the MetricsHub.
"""

from dataclasses import dataclass, field
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from kvcore.entrypoints.openai import responses, serving
from kvcore.entrypoints.openai.metrics import CONTENT_TYPE
from kvcore.entrypoints.openai.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from kvcore.entrypoints.openai.protocol import parse_body as _parse
from kvcore.scaleout.merge import merge_metrics

PARSERS = {"completion": CompletionRequest, "chat": ChatCompletionRequest}


@dataclass
class RoutedRequest:
    """What the ingress sends a replica: the raw body and the first prompt's token ids."""

    kind: str  # "completion" | "chat"
    body: bytes
    token_ids: list[int] = field(default_factory=list)

    @property
    def prompt(self) -> str:
        """The ids as text for Ray's PrefixCacheAffinityRouter (``--router ray-prefix``), which
        reads a ``prompt`` attribute and matches characters: one character per token id, so
        its match rate and its tree's size count tokens."""
        return "".join(map(chr, self.token_ids))


def _replica_failed(e: BaseException) -> JSONResponse:
    err = ApiError(
        503,
        f"The replica serving this request failed ({type(e).__name__}); retry.",
        type="server_error",
        code="replica_failed",
        headers={"Retry-After": "1"},
    )
    return JSONResponse(err.body(), status_code=503, headers=err.headers)


_RAY_FAILURES: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
)


def make_ingress(api_key: str | None, hub_name: str, stale_s: float = 10.0):
    """The ingress deployment class (a FastAPI app bound to the engine deployment's handle)."""
    from kvcore.entrypoints.openai.server import authorize, read_body

    app = FastAPI(title="kvcore", docs_url=None, redoc_url=None, openapi_url=None)

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class Ingress:
        async def __init__(self, engine: Any, prefill: Any = None):
            self.engine, self.prefill = engine, prefill
            info = await engine.info.remote()
            self.state = serving.ServerState(engine=None, api_key=api_key, **info)
            self.hub = ray.get_actor(hub_name)

        async def _send(self, request: Request, kind: str) -> Response:
            authorize(self.state, request)
            raw = await read_body(self.state, request)
            parsed = _parse(PARSERS[kind], raw)
            prepare = serving.prepare_chat if kind == "chat" else serving.prepare_completion
            job = prepare(self.state, parsed)  # 400/404 here, before any replica works
            routed = RoutedRequest(kind, raw, job.prompts[0])
            try:
                if self.prefill is not None:  # disaggregated: the prompt's KV first
                    status, body, headers = await self.prefill.prefill.remote(routed)
                    if status != 200:
                        return JSONResponse(body, status_code=status, headers=headers)
                if not parsed.stream:
                    status, body, headers = await self.engine.complete.remote(routed)
                    return JSONResponse(body, status_code=status, headers=headers)
                gen = self.engine.options(stream=True).stream.remote(routed)
                status, body, headers = await gen.__anext__()
            except _RAY_FAILURES as e:
                return _replica_failed(e)
            if body is not None:
                return JSONResponse(body, status_code=status, headers=headers)

            async def chunks():
                try:
                    async for chunk in gen:
                        yield chunk
                except _RAY_FAILURES as e:  # headers are sent: an in-band error event
                    err = {"error": {"message": f"replica failed: {type(e).__name__}"}}
                    yield responses._event(err)

            return StreamingResponse(chunks(), media_type="text/event-stream", headers=headers)

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            try:
                return await self._send(request, "completion")
            except ApiError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.post("/v1/chat/completions")
        async def chat(self, request: Request) -> Response:
            try:
                return await self._send(request, "chat")
            except ApiError as e:
                return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.get("/v1/models")
        async def models(self, request: Request) -> Response:
            try:
                authorize(self.state, request)
            except ApiError as e:
                return JSONResponse(e.body(), status_code=e.status)
            card = {"id": self.state.model_name, "object": "model", "created": 0}
            card |= {"owned_by": "kvcore", "max_model_len": self.state.max_model_len}
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/health")
        async def health(self) -> JSONResponse:
            latest = await self.hub.collect.remote(stale_s)
            replicas = [h for _, _, h in latest.values()]
            return JSONResponse(
                {"status": "ok" if replicas else "no replica", "replicas": replicas},
                status_code=200 if replicas else 503,
            )

        @app.get("/metrics")
        async def metrics(self) -> Response:
            latest = await self.hub.collect.remote(stale_s)
            text = merge_metrics({name: t for name, (_, t, _) in latest.items()})
            return Response(text, media_type=CONTENT_TYPE)

    return Ingress
