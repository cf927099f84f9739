"""``kvcore serve --replicas N``: engine replicas on Ray Serve behind the OpenAI ingress.

::

    client ──HTTP──► Ingress (FastAPI, 1 replica)          EngineReplica × N (one LLM each)
                     parse, auth, tokenize, 400s ──handle──► serving.run ─► JSON body / SSE
                     KvcoreRequestRouter picks the replica    pushes /metrics text ─► MetricsHub
                     /metrics: hub texts merged, replica="…"

The ingress validates a request exactly as ``kvcore serve`` does (``serving.prepare_*``) and
sends the body with its prompt's token ids (``RoutedRequest``) through the deployment handle;
the request router (``ray_router.py``) reads the ids. A replica answers with a status and body
(errors never cross Ray as exceptions). A replica that dies takes its in-flight requests with
it: they get 503 + ``Retry-After`` (``code: replica_failed``), not a retry (a request may have
streamed tokens already, and sampling is not idempotent); Serve's controller starts a new
replica and the router drops the dead one's tree.
"""

import threading
import time
from typing import Any

import ray
from ray import serve

from kvcore.entrypoints.openai import responses, serving
from kvcore.entrypoints.openai.protocol import ApiError
from kvcore.entrypoints.openai.protocol import parse_body as _parse
from kvcore.params import SamplingParams
from kvcore.scaleout.ray_ingress import PARSERS, RoutedRequest, make_ingress

ROUTERS = {  # --router: (request router class, its kwargs)
    "prefix": ("kvcore.scaleout.ray_router:KvcoreRequestRouter", {"policy": "prefix"}),
    "p2c": ("kvcore.scaleout.ray_router:KvcoreRequestRouter", {"policy": "p2c"}),
    "random": ("kvcore.scaleout.ray_router:KvcoreRequestRouter", {"policy": "random"}),
    "ray-p2c": (None, {}),  # Ray Serve's default PowerOfTwoChoicesRequestRouter
    # Ray Serve LLM's PrefixCacheAffinityRouter, with Ray's defaults. Its public alias
    # (ray.serve.llm.request_router) imports ray.serve.llm, which needs pyarrow: the defining
    # module needs only Ray Serve.
    "ray-prefix": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
        ":PrefixCacheAffinityRouter",
        {},
    ),
}


@ray.remote(num_cpus=0)
class MetricsHub:
    """Latest /metrics text and /health snapshot pushed by each replica."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, str, dict]] = {}

    def ready(self) -> bool:
        return True

    def put(self, replica: str, text: str, health: dict) -> None:
        self.latest[replica] = (time.time(), text, health)

    def collect(self, max_age_s: float) -> dict[str, tuple[float, str, dict]]:
        now = time.time()  # a replica silent for max_age_s is gone (dead or removed)
        self.latest = {k: v for k, v in self.latest.items() if now - v[0] <= max_age_s}
        return self.latest


def replica_parser() -> Any:
    """The flags a replica reads from ``kvcore serve``'s argv: the engine's and the server's
    (scale-out's own flags are the driver's; they are ignored here)."""
    import argparse

    from kvcore.engine.args import EngineArgs
    from kvcore.entrypoints.openai.args import add_server_args

    p = argparse.ArgumentParser(prog="kvcore serve (replica)")
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    return p


def _replica_flags(argv: list[str]) -> Any:
    return replica_parser().parse_known_args(list(argv))[0]


def _state_for(args: Any) -> serving.ServerState:
    """A replica's server state: its engine in an engine-core process of its own, as
    ``kvcore serve`` (or in the replica's process with ``--engine-in-process``)."""
    from kvcore.engine.factory import make_engine
    from kvcore.entrypoints.openai.server import make_state, start_state

    if args.engine_in_process:
        return make_state(make_engine(args), args)
    return start_state(make_engine, args)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EngineReplica:
    """One engine (``kvcore serve``'s AsyncEngine over an LLM) serving routed requests."""

    def __init__(self, argv: list[str], hub_name: str, push_s: float = 1.0):
        self.state = _state_for(_replica_flags(argv))
        ctx = serve.get_replica_context()
        self.name = ctx.replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self._hub = ray.get_actor(hub_name)
        self._push_s = push_s
        threading.Thread(target=self._push_loop, daemon=True).start()

    def _push_loop(self) -> None:
        while self.state.engine.running:
            self._hub.put.remote(self.name, self.state.metrics.render().decode(), self.health())
            time.sleep(self._push_s)

    def info(self) -> dict[str, Any]:
        s = self.state
        return dict(
            tokenizer=s.tokenizer,
            model_name=s.model_name,
            max_model_len=s.max_model_len,
            vocab_size=s.vocab_size,
            max_n=s.max_n,
            max_body_bytes=s.max_body_bytes,
        )

    def health(self) -> dict[str, Any]:
        return {"replica": self.name, "actor_name": self.actor_name, **self.state.engine.snapshot}

    def _job(self, req: RoutedRequest) -> serving.Job:
        parsed = _parse(PARSERS[req.kind], req.body)
        prepare = serving.prepare_chat if req.kind == "chat" else serving.prepare_completion
        return prepare(self.state, parsed)

    async def complete(self, req: RoutedRequest) -> tuple[int, Any, dict]:
        """(status, JSON body, headers) of a non-streaming request."""
        mine = {"x-kvcore-replica": self.actor_name}
        try:
            job = self._job(req)
            try:
                outputs = await serving.run(self.state, job)
                return 200, await responses.collect(self.state, job, outputs), mine
            finally:
                job.close()
        except ApiError as e:
            return e.status, e.body(), {**e.headers, **mine}

    async def prefill(self, req: RoutedRequest) -> tuple[int, Any, dict]:
        """Disaggregated prefill: compute the prompt's KV here and write it through to the
        shared tier, then return (the decode replica loads it). The request runs for two
        greedy tokens: the second step's plan carries the publish of the prompt's blocks."""
        mine = {"x-kvcore-prefill-replica": self.actor_name}
        try:
            job = self._job(req)
            job.req = job.req.model_copy(update={"stream": False, "n": 1})
            job.params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]
            job.prompts = job.prompts[:1]  # one prompt: what the router routed
            try:
                async for _ in await serving.run(self.state, job):
                    pass
            finally:
                job.close()
        except ApiError as e:
            return e.status, e.body(), {**e.headers, **mine}
        done = await self.state.engine.call("wait_published", 10.0)
        cached = sum(o.num_cached_tokens for o in job.finals.values())
        return 200, {"published": done, "cached_tokens": cached}, mine

    async def stream(self, req: RoutedRequest):
        """First item (status, error body or None, headers), then the SSE byte chunks."""
        mine = {"x-kvcore-replica": self.actor_name}
        try:
            job = self._job(req)
            outputs = await serving.run(self.state, job)
        except ApiError as e:
            yield e.status, e.body(), {**e.headers, **mine}
            return
        yield 200, None, mine
        try:
            async for chunk in responses.sse(self.state, job, outputs):
                yield chunk
        finally:
            job.close()


def build_app(
    argv: list[str],
    *,
    replicas: int = 2,
    router: str = "prefix",
    router_kwargs: dict[str, Any] | None = None,
    api_key: str | None = None,
    hub_name: str = "kvcore-metrics",
    max_ongoing_requests: int = 64,
    prefill_replicas: int = 0,
):
    """The Serve application (ingress bound to N engine replicas) for ``serve.run``; Ray must
    be initialised. ``argv``: ``kvcore serve`` engine flags of every replica (``--model`` ...).
    With ``prefill_replicas`` P > 0, P prefill replicas compute prompts into the shared tier
    (``--remote-url`` and ``--host-kv-mb`` required) and the N replicas decode."""
    from ray.serve.config import RequestRouterConfig

    if prefill_replicas < 0:
        raise ValueError(f"prefill_replicas must be >= 0, got {prefill_replicas}")
    if prefill_replicas:
        flags = _replica_flags(argv)
        if not flags.remote_url or flags.host_kv_bytes <= 0:
            raise ValueError(
                "disaggregated prefill needs the shared tier: --remote-url redis://... and "
                "--host-kv-mb > 0 in the replicas' flags"
            )

    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}: one of {sorted(ROUTERS)}")
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    cls, kwargs = ROUTERS[router]
    options: dict[str, Any] = dict(num_replicas=replicas, max_ongoing_requests=max_ongoing_requests)
    if cls is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=cls, request_router_kwargs={**kwargs, **(router_kwargs or {})}
        )
    hub = MetricsHub.options(name=hub_name, get_if_exists=True, lifetime="detached").remote()
    ray.get(hub.ready.remote())  # replicas look it up by name: it must exist before they start
    engine = EngineReplica.options(**options).bind(list(argv), hub_name)
    prefill = None
    if prefill_replicas:
        options = {**options, "num_replicas": prefill_replicas, "name": "PrefillReplica"}
        prefill = EngineReplica.options(**options).bind(list(argv), hub_name)
    return make_ingress(api_key, hub_name).bind(engine, prefill)


def deploy(
    argv: list[str],
    *,
    replicas: int = 2,
    router: str = "prefix",
    router_kwargs: dict[str, Any] | None = None,
    ray_address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    name: str = "kvcore",
    num_cpus: int | None = None,
    prefill_replicas: int = 0,
):
    """Start (or join, ``ray_address``) Ray, deploy the app on ``host:port`` and return the
    ingress handle. ``argv``: the replicas' ``kvcore serve`` engine flags."""
    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address)
        else:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=200 << 20,
                log_to_driver=False,
            )
    serve.start(http_options={"host": host, "port": port})
    app = build_app(
        argv,
        replicas=replicas,
        router=router,
        router_kwargs=router_kwargs,
        api_key=api_key,
        prefill_replicas=prefill_replicas,
    )
    return serve.run(app, name=name, route_prefix="/")
