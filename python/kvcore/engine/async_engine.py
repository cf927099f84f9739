"""AsyncEngine: one background thread owns an LLMEngine; asyncio handlers share its steps.

::

    handler (event loop)                          engine thread (sole caller of LLMEngine)
    ─────────────────────                         ─────────────────────────────────────────
    submit() ── ("add", stream) ──► inbox ──►     drain inbox: add_request / abort_request
             ◄── ACCEPTED or error ─┐             step()  ── outputs ──┐
    async for out in stream ◄───────┴── call_soon_threadsafe(batch) ◄──┘  (one call per step)
    client gone ── ("abort", id) ──► inbox        aborted before the next step, blocks freed

The inbox is a ``queue.SimpleQueue`` drained before every step, so concurrent requests join the
running batch at the next step (continuous batching across HTTP clients). A failing ``step()``
fails the streams it was serving with ``EngineError`` (a 500 for their clients), aborts their
requests and the loop goes on serving new ones. Streaming outputs are cumulative snapshots, so a
slow consumer may skip intermediate ones without losing tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine.inspect import engine_view
from kvcore.errors import KvCoreError, UnknownRequestError
from kvcore.outputs import RequestOutput
from kvcore.params import SamplingParams

log = logging.getLogger("kvcore.scaleout")

ACCEPTED = object()  # first item of a stream once the engine took the request


class EngineError(Exception):
    """The engine failed while serving a request (its client gets a 500)."""


class EngineDeadError(EngineError):
    """The engine process is gone: the request cannot finish (its client gets a 503)."""


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class AsyncEngine:
    """Runs ``engine.step()`` in a thread while asyncio handlers submit and stream requests."""

    def __init__(self, engine: Any, *, metrics: Any = None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Add] = {}  # engine thread only
        self._pending = 0  # adds in the inbox, not yet in the engine
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self.snapshot: dict[str, Any] = {}  # replaced (never mutated) by the engine thread
        self._publish()
        self._thread = threading.Thread(target=self._run, name="kvcore-engine", daemon=True)
        self._thread.start()

    # ---- the handlers' side (event loop thread) ----------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: in the inbox plus the scheduler's waiting queue."""
        return self._pending + int(self.snapshot.get("num_waiting", 0))

    @property
    def running(self) -> bool:
        """False once stopped or if the engine thread died."""
        return self._thread.is_alive() and not self._stop.is_set()

    async def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        stream: bool = True,
    ) -> RequestStream:
        """Queue one request; returns its output stream once the engine accepted it (with
        ``stream=False`` the stream yields only the final output, decoded once at the end).

        Raises the engine's ``KvCoreError`` (bad input), or ``EngineError``.
        """
        if not self.running:
            raise EngineError("the engine is not running")
        loop = asyncio.get_running_loop()
        add = _Add(request_id, prompt, params, priority, cache_salt, stream, loop)
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(("add", add))
        self._wake.set()
        try:
            first = await add.queue.get()
        except BaseException:  # cancelled while waiting: make sure the engine lets it go
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, add)

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step (no-op if it already finished)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def cut(self, why: str) -> None:
        """End what still runs (the server's shutdown at the end of its grace period): here,
        stopping the engine thread aborts every open request."""
        self.stop(timeout=0)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.clear()
            deliveries: list[tuple[_Add, Any]] = []
            self._drain(deliveries)
            if self._stop.is_set():
                self._abort_all(deliveries, "the server is shutting down")
                self._publish()
                self._deliver(deliveries)
                return
            if not self.engine.has_unfinished_requests():
                self._publish()
                self._deliver(deliveries)
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the loop must survive any engine failure
                log.exception("engine step failed")
                self._fail_all(deliveries, e)
                self._publish()
                self._deliver(deliveries)
                continue
            for out in outputs:
                add = self._streams.get(out.request_id)
                if add is None:
                    continue
                deliveries.append((add, out))
                if out.finished:
                    del self._streams[out.request_id]
            if self.metrics is not None:
                self.metrics.observe_step(self.engine, outputs)
            self._publish()  # before delivering: a client that got its output sees the state
            self._deliver(deliveries)

    def _drain(self, deliveries: list[tuple[_Add, Any]]) -> None:
        engine = self.engine
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                if self._streams.pop(item, None) is not None:
                    with contextlib.suppress(UnknownRequestError):
                        outs = engine.abort_request(item)
                        if self.metrics is not None:
                            self.metrics.observe_step(engine, outs)
                continue
            with self._pending_lock:
                self._pending -= 1
            try:
                if self._stop.is_set():
                    raise EngineError("the server is shutting down")
                engine.add_request(
                    item.prompt,
                    item.params,
                    request_id=item.request_id,
                    priority=item.priority,
                    stream=item.stream,
                    cache_salt=item.cache_salt,
                )
            except (KvCoreError, EngineError) as e:
                deliveries.append((item, e))
            except Exception as e:  # noqa: BLE001
                log.exception("add_request failed")
                deliveries.append((item, EngineError(f"add_request failed: {e}")))
            else:
                self._streams[item.request_id] = item
                deliveries.append((item, ACCEPTED))

    def _fail_all(self, deliveries: list[tuple[_Add, Any]], error: BaseException) -> None:
        err = EngineError(f"engine step failed: {type(error).__name__}: {error}")
        for rid, add in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(rid)
            deliveries.append((add, err))
        self._streams.clear()
        if self.engine.has_unfinished_requests():
            time.sleep(0.05)  # a broken engine: don't spin

    def _abort_all(self, deliveries: list[tuple[_Add, Any]], why: str) -> None:
        for rid, add in list(self._streams.items()):
            try:
                outs = self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                deliveries.append((add, EngineError(why)))
                continue
            deliveries.extend((add, o) for o in outs)
        self._streams.clear()

    @staticmethod
    def _deliver(deliveries: list[tuple[_Add, Any]]) -> None:
        if not deliveries:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Add, Any]]] = {}
        for add, item in deliveries:
            by_loop.setdefault(add.loop, []).append((add, item))
        deliveries.clear()
        for loop, batch in by_loop.items():  # one wake-up of each event loop per step
            with contextlib.suppress(RuntimeError):  # that event loop already closed
                loop.call_soon_threadsafe(_put_all, batch)

    def _publish(self) -> None:
        self.snapshot = engine_snapshot(self.engine)
        if self.metrics is not None:
            self.metrics.observe_snapshot(self.snapshot)

    async def call(self, name: str, *args: Any) -> Any:
        """A utility call on the engine (``wait_published``, ``tier_figures``), off the loop."""
        if name == "wait_published":
            tiers = self.engine.tiers
            return bool(await asyncio.to_thread(tiers.wait_published, *args)) if tiers else False
        if name == "tier_figures":
            return self.engine.tier_figures()
        if name == "dashboard_view":
            return engine_view(self.engine)
        raise ValueError(f"unknown engine call {name!r}")


def engine_snapshot(engine: Any) -> dict[str, Any]:
    """The scheduler's state that /health and the gauges show (read between steps)."""
    st = engine.scheduler.stats()
    num_blocks = int(engine.runner.num_blocks) - 1  # without the null block
    return {
        "num_running": int(st.num_running),
        "num_waiting": int(st.num_waiting),
        "num_unfinished": int(engine.get_num_unfinished_requests()),
        "num_free_blocks": int(st.num_free_blocks),
        "num_blocks": num_blocks,
        "all_blocks_free": int(st.num_free_blocks) == num_blocks,
        "kv_usage": float(st.kv_usage),
        "prefix_query_tokens": int(st.prefix_query_tokens),
        "prefix_hit_tokens": int(st.prefix_hit_tokens),
        "num_preemptions": int(st.num_preemptions),
        "num_steps": int(engine.stats.num_steps),
    }


class RequestStream:
    """Async iterator over one request's outputs. Snapshots are cumulative, so a consumer that
    fell behind gets only the newest. ``close()`` (also on any error or cancellation while
    waiting) aborts the request unless it finished: a request is never left running unread."""

    def __init__(self, engine: AsyncEngine, add: _Add):
        self._engine, self._add = engine, add
        self._done = False  # finished, failed or closed
        self.request_id = add.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        q = self._add.queue
        try:
            item = await q.get()
        except BaseException:
            self.close()
            raise
        while not isinstance(item, BaseException) and not q.empty():
            item = q.get_nowait()  # an error or a newer snapshot replaces it
        if isinstance(item, BaseException):
            self._done = True  # the engine already let go of it
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        """Abort the request at the next step unless it already finished."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        """Same as ``close()`` (async-generator style)."""
        self.close()


def _put_all(batch: list[tuple[_Add, Any]]) -> None:
    for add, item in batch:
        add.queue.put_nowait(item)
