"""EngineCoreClient: the front-end's handle on the engine-core process (``core_proc.py``).

It has ``AsyncEngine``'s interface (``submit`` → ``RequestStream``, ``abort``, ``stop``,
``snapshot``, ``num_waiting``, ``running``, ``call``), so the server runs over either.

::

    event loop (handlers)                 receiver thread                engine process
    submit/abort ─► batch of this turn ─── one EngineInputs ──────────►  step
    stream.queue ◄── call_soon_threadsafe ◄── deltas → text, stop ◄──── one EngineOutputs
                     (one per loop per step)   strings, snapshots         per step
    watcher thread: the process exited ──► every open request fails (EngineDeadError), on_dead()

Adds and aborts made during one event-loop turn leave in one message (flushed by
``call_soon``). The receiver thread detokenizes and matches stop strings (``output_processor``)
and hands each event loop its outputs in one wake-up per step. A request is only forgotten
when the engine's final delta arrives (an abort's too), so the metrics count every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from kvcore import errors
from kvcore.engine.async_engine import (
    ACCEPTED,
    EngineDeadError,
    EngineError,
    RequestStream,
    _put_all,
)
from kvcore.engine.core_messages import (
    AddRequest,
    EngineInputs,
    EngineOutputs,
    decoder,
    encoder,
)
from kvcore.engine.inputs import priorities
from kvcore.engine.output_processor import TrackedRequest
from kvcore.params import SamplingParams

log = logging.getLogger("kvcore.engine")


#: libgomp's spin-wait before a waiting OpenMP thread sleeps, for the engine process unless the
#: environment sets ``GOMP_SPINCOUNT``: a decode step runs ~300 parallel regions microseconds
#: apart, and a worker asleep between two of them costs a futex wake-up each time. Under
#: ``OMP_WAIT_POLICY=PASSIVE`` (spin 0) SmolLM2's bf16 decode step at 1 / 4 / 16 requests took
#: 25.0 / 24.9 / 35.6 ms against 14.2 / 15.4 / 22.5 with libgomp's default spin (300,000); with
#: 20,000 it took 14.6 / 15.6 / 22.5 (2 threads, `docs/serving.md`). Bounded, the workers still
#: sleep between steps instead of taking the front-end's core.
ENGINE_SPIN_COUNT = 20_000


def engine_env(environ: Any) -> dict[str, str]:
    """The engine process's environment: ``environ`` with ``GOMP_SPINCOUNT`` defaulted."""
    env = dict(environ)
    env.setdefault("GOMP_SPINCOUNT", str(ENGINE_SPIN_COUNT))
    return env


class _Stream:
    """What ``RequestStream`` reads: the request id and its output queue."""

    __slots__ = ("request_id", "queue", "loop")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id, self.loop, self.queue = request_id, loop, asyncio.Queue()


class EngineCoreClient:
    """Starts the engine process and talks to it; see the module docstring."""

    def __init__(
        self,
        make_engine: Any,
        args: Any,
        *,
        metrics: Any = None,
        start_timeout_s: float = 600.0,
        on_dead: Any = None,
    ):
        self.metrics = metrics
        self.on_dead = on_dead  # called (in the watcher thread) once the process died
        self.snapshot: dict[str, Any] = {}
        self.dead: str | None = None  # why the engine is gone, once it is
        self._stopping = False
        self._tmp = tempfile.mkdtemp(prefix="kvcore-engine-")
        self._ctx = zmq.Context(1)
        in_addr, out_addr = f"ipc://{self._tmp}/in", f"ipc://{self._tmp}/out"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(out_addr)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcore.engine.core_proc", in_addr, out_addr],
            stdin=subprocess.PIPE,
            env=engine_env(os.environ),
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(pickle.dumps((make_engine, args)))
        self.proc.stdin.close()
        self.info = self._wait_ready(start_timeout_s)
        self.tokenizer = self.info["tokenizer"]
        self.snapshot = self.info.pop("snapshot")
        self._enc, self._dec = encoder(), decoder(EngineOutputs)
        self._send_lock = threading.Lock()
        self._pending = EngineInputs()
        self._flush_scheduled = False
        self._tracked: dict[str, TrackedRequest] = {}
        self._lock = threading.Lock()  # guards _tracked and _pending between the threads
        self._num_pending_adds = 0
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._receiver = threading.Thread(target=self._receive, name="kvcore-rx", daemon=True)
        self._receiver.start()
        threading.Thread(target=self._watch, name="kvcore-engine-watch", daemon=True).start()

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._pull.poll(200):
                kind, body = pickle.loads(self._pull.recv())
                if kind == "ready":
                    return body
                self.proc.wait(30)
                raise RuntimeError(f"the engine process failed to start:\n{body}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited ({self.proc.returncode})")
        self.proc.kill()
        raise RuntimeError(f"the engine process did not start within {timeout:.0f} s")

    # ---- the handlers' side (any event loop) -----------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the engine: sent, not accepted yet, plus its waiting queue."""
        return self._num_pending_adds + int(self.snapshot.get("num_waiting", 0))

    @property
    def running(self) -> bool:
        """False once stopped or if the engine process died."""
        return self.dead is None and not self._stopping and self.proc.poll() is None

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
        """Send one request; returns its stream once the engine accepted it. Raises the
        engine's ``KvCoreError`` (bad input), ``EngineError`` or ``EngineDeadError``."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if not self.running:
            raise EngineError("the engine is not running")
        # The engine's own rule, checked here too: a value msgpack cannot carry must fail its
        # own request, not the message it would share with others.
        priorities(priority, 1)
        loop = asyncio.get_running_loop()
        sink = _Stream(request_id, loop)
        req = TrackedRequest(request_id, list(prompt), params, self.tokenizer, stream, sink)
        add = AddRequest(
            request_id, req.prompt_token_ids, req.engine_params(), priority, cache_salt,
            req.engine_stream,
        )  # fmt: skip
        with self._lock:
            if request_id in self._tracked:
                raise errors.DuplicateRequestError(f"request id already running: {request_id}")
            self._tracked[request_id] = req
            self._num_pending_adds += 1
            self._pending.adds.append(add)
        self._schedule_flush(loop)
        try:
            first = await sink.queue.get()
        except BaseException:
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, sink)  # type: ignore[arg-type]

    def abort(self, request_id: str) -> None:
        """Abort a request in the engine (no-op once it finished); nothing more is delivered."""
        with self._lock:
            req = self._tracked.get(request_id)
            if req is None or req.closed:
                return
            req.closed = True
            self._pending.aborts.append(request_id)
        self._schedule_flush(None)

    def cut(self, why: str) -> None:
        """End every open request now with ``EngineError(why)`` (streams get an error event) and
        abort them in the engine, which keeps running until ``stop`` (the server's shutdown at
        the end of its grace period)."""
        with self._lock:
            for rid, req in self._tracked.items():
                if not req.closed:
                    self._pending.aborts.append(rid)
        self._flush()
        self._fail_all(EngineError(why))

    async def call(self, name: str, *args: Any) -> Any:
        """A utility call in the engine process (``wait_published``, ``tier_figures``)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = (loop, fut)
            self._pending.calls.append((call_id, name, list(args)))
        self._schedule_flush(loop)
        result = await fut
        if isinstance(result, dict) and set(result) == {"error"}:
            raise EngineError(result["error"])
        return result

    def _schedule_flush(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._flush()
                return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send what this event-loop turn queued, as one message. The event loop and the
        receiver thread (stop-string aborts) both flush: taking the queue and sending it under
        one lock keeps the messages in the order their contents were queued (else an add could
        reach the engine after its own abort, and run to its end unread)."""
        with self._send_lock:
            with self._lock:
                self._flush_scheduled = False
                msg, self._pending = self._pending, EngineInputs()
            if not (msg.adds or msg.aborts or msg.calls or msg.shutdown):
                return
            try:
                data = self._enc.encode(msg)
            except (OverflowError, TypeError, ValueError):
                data = self._encode_without_bad_adds(msg)
            if not self._push.closed:
                self._push.send(data, copy=False)

    def _encode_without_bad_adds(self, msg: EngineInputs) -> bytes:
        """A request the encoder refuses (a value msgpack cannot carry that validation let
        through) fails alone with a 400-class error; the rest of the message still goes.
        Without this, the message would be lost and every request in it would wait forever."""
        good: list[AddRequest] = []
        bad: list[tuple[AddRequest, Exception]] = []
        for add in msg.adds:
            try:
                self._enc.encode(add)
                good.append(add)
            except (OverflowError, TypeError, ValueError) as e:
                bad.append((add, e))
        msg.adds = good
        deliveries = []
        with self._lock:
            for add, e in bad:
                req = self._tracked.pop(add.request_id, None)
                if req is not None:
                    self._num_pending_adds -= 1
                    err = errors.InvalidArgumentError(f"the request cannot be sent: {e}")
                    deliveries.append((req.sink, err))
        for add, e in bad:
            log.error("kvcore: request %s refused: %s", add.request_id, e)
        _deliver(deliveries)
        return self._enc.encode(msg)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the engine to abort what is left and exit; wait for it (then kill it)."""
        if self._stopping:
            return
        self._stopping = True
        if self.proc.poll() is None:
            with self._lock:
                self._pending.shutdown = True
            self._flush()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._receiver.join(5)
        self._fail_all(EngineError("the server is shutting down"))
        with self._send_lock:
            self._push.close(linger=0)
        with contextlib.suppress(OSError):
            for name in ("in", "out"):
                os.unlink(os.path.join(self._tmp, name))
            os.rmdir(self._tmp)

    # ---- the receiver and watcher threads ----------------------------------------------

    def _receive(self) -> None:
        pull = self._pull
        while True:
            if not pull.poll(100):
                if self.proc.poll() is not None:
                    break
                continue
            msg = self._dec.decode(pull.recv(copy=False).buffer)
            self._handle(msg)
            if msg.bye:
                break
        pull.close(linger=0)

    def _handle(self, msg: EngineOutputs) -> None:
        deliveries: list[tuple[Any, Any]] = []
        finished = []
        aborts = []
        with self._lock:
            tracked = self._tracked
            for rid, arrival in msg.accepted:
                req = tracked.get(rid)
                if req is not None:
                    self._num_pending_adds -= 1
                    req.accepted = True
                    req.metrics.arrival_time = arrival
                    deliveries.append((req.sink, ACCEPTED))
            for rid, cls, text in msg.rejected:
                req = tracked.pop(rid, None)
                if req is not None:
                    self._num_pending_adds -= 1
                    err = getattr(errors, cls, None)
                    ok = isinstance(err, type) and issubclass(err, errors.KvCoreError)
                    deliveries.append((req.sink, err(text) if ok else EngineError(text)))
            for d in msg.deltas:
                req = tracked.get(d.request_id)
                if req is None:
                    continue
                ended_here = req.apply(d, msg.time)
                if d.finished:
                    del tracked[d.request_id]
                    if d.error is not None:
                        req.finish_on_error(msg.time)
                    finished.append(req)
                    if req.closed or req.delivered_final:
                        continue
                    item = req.output(True, d.error)
                    if d.error is not None:
                        item = EngineError(d.error)
                    deliveries.append((req.sink, item))
                elif ended_here:  # every sample hit a stop string: done here, abort there
                    if not req.closed:
                        deliveries.append((req.sink, req.output(True)))
                    req.delivered_final = req.closed = True
                    aborts.append(d.request_id)
                elif req.stream and not req.closed:
                    deliveries.append((req.sink, req.output(False)))
            self._pending.aborts.extend(aborts)
            results = [(self._calls.pop(cid, None), r) for cid, r in msg.results]
        if aborts:
            self._flush()
        if msg.snapshot is not None:
            self.snapshot = msg.snapshot
        if self.metrics is not None:
            if msg.snapshot is not None:
                self.metrics.observe_snapshot(msg.snapshot)
            if finished:
                self.metrics.observe_step(None, [r.output(True) for r in finished])
        _deliver(deliveries)
        for target, result in results:
            if target is not None:
                loop, fut = target
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_resolve, fut, result)

    def _watch(self) -> None:
        code = self.proc.wait()
        if self._stopping and code == 0:
            return
        self._receiver.join(2)  # what it had sent before dying still counts
        why = f"the engine process died (exit code {code})"
        if self._stopping:
            why = f"the engine process exited with code {code} while stopping"
        self.dead = why
        log.error("kvcore: %s; failing every open request", why)
        self._fail_all(EngineDeadError(why))
        if self.on_dead is not None:
            self.on_dead(why)

    def _fail_all(self, error: EngineError) -> None:
        with self._lock:
            reqs = list(self._tracked.values())
            self._tracked.clear()
            self._num_pending_adds = 0
            calls = list(self._calls.values())
            self._calls.clear()
        now = time.perf_counter()
        deliveries = []
        for req in reqs:
            req.finish_on_error(now)
            if not req.closed and not req.delivered_final:
                deliveries.append((req.sink, error))
        if self.metrics is not None and reqs:
            self.metrics.observe_step(None, [r.output(True) for r in reqs])
        _deliver(deliveries)
        for loop, fut in calls:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut, {"error": str(error)})


def _deliver(deliveries: list[tuple[Any, Any]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    for sink, item in deliveries:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():  # one wake-up of each event loop per step
        with contextlib.suppress(RuntimeError):  # that event loop already closed
            loop.call_soon_threadsafe(_put_all, batch)


def _resolve(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)
