"""The engine-core process of ``kvcore serve``: schedule → forward → sample, and nothing else.

::

    front-end process                          engine-core process (this module)
    ─────────────────                          ──────────────────────────────────
    EngineInputs ── PUSH ──ipc──► PULL ──►     drain every waiting message: add / abort / call
                                               engine.step()
    EngineOutputs ◄── PULL ◄──ipc── PUSH ◄──   one message: accepted, rejected, token deltas,
                                               the scheduler snapshot

Started by ``EngineCoreClient`` as ``python -m kvcore.engine.core_proc IN OUT`` with the pickled
``(make_engine, args)`` on stdin: ``make_engine(args)`` builds the ``LLMEngine`` (the one place
the server constructs it). The first message out is the pickled ``engine_info`` (or the
traceback of a failed start, then exit 1).

The process never blocks on the front-end: its PUSH socket has no high-water mark, so a
front-end that stops reading costs memory, never a step. It ignores SIGINT/SIGTERM (the
front-end drains, then sends ``shutdown``) and exits when its parent dies (``getppid`` changes;
checked every turn, so within a step or 200 ms). Quick utility calls (the dashboard's view,
the tier figures, ~1 ms) run in the loop between steps: a side thread would wait on the
engine's state lock, which a busy step loop re-takes before a waiter wakes (seen: a view
starved for over 10 s under five streams on 2 cores). Blocking ones (``wait_published``) run
in a side thread.

``KVCORE_STEP_LOG=PATH`` appends one line per step to PATH: the step's start
(``time.perf_counter``, the clock of every process on the machine), its seconds, the tokens and
the sequences it ran. ``benches/tools/ttft_breakdown.py`` lines them up with a load generator's
per-request records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from kvcore.engine.async_engine import engine_snapshot
from kvcore.engine.core_messages import (
    EngineInputs,
    EngineOutputs,
    RequestDelta,
    decoder,
    encoder,
)
from kvcore.engine.inspect import engine_view
from kvcore.errors import KvCoreError, UnknownRequestError

log = logging.getLogger("kvcore.engine")


def engine_info(engine: Any) -> dict[str, Any]:
    """What the front-end needs from the engine (picklable): limits, tokenizer, cache labels."""
    cc = engine.cache_config
    return {
        "tokenizer": engine.tokenizer,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "max_num_seqs": engine.scheduler_config.max_num_seqs,
        "block_size": cc.block_size,
        "num_blocks": engine.runner.num_blocks - 1,
        "kv_format": str(cc.kv_format),
        "quantized": bool(cc.quantized),
        "kv_dtype": str(engine.runner.kv_dtype).removeprefix("torch."),
        "model_dtype": str(engine.model.dtype).removeprefix("torch."),
        "prefix_caching": cc.prefix_caching,
    }


_INLINE = frozenset({"dashboard_view", "tier_figures"})  # utility calls that never block


class EngineCoreProc:
    """The busy loop over one engine and its two sockets."""

    def __init__(self, engine: Any, pull: zmq.Socket, push: zmq.Socket):
        self.engine, self.pull, self.push = engine, pull, push
        self._dec, self._enc = decoder(EngineInputs), encoder()
        self._sent: dict[str, list[int]] = {}  # live request -> tokens sent per sample
        self._scheduled: set[str] = set()  # live requests whose first token was sent
        self._results: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._calls_pending = 0
        self._parent = os.getppid()
        path = os.environ.get("KVCORE_STEP_LOG")
        self._step_log = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._utility = {
            "wait_published": self._wait_published,
            "tier_figures": self._figures,
            "dashboard_view": self._dashboard_view,
        }

    # ---- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        out = EngineOutputs(time.perf_counter())
        while True:
            busy = self.engine.has_unfinished_requests()
            timeout = 0 if busy else (5 if self._calls_pending else 200)
            shutdown = False
            if self.pull.poll(timeout):
                while True:
                    try:
                        frame = self.pull.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    shutdown |= self._handle(self._dec.decode(frame.buffer), out)
            if os.getppid() != self._parent:
                return  # the front-end is gone (a cheap syscall, checked every turn)
            self._collect_results(out)
            if shutdown:
                self._abort_all(out, None)
                out.bye = True
                self._send(out)
                return
            if self.engine.has_unfinished_requests():
                self._step(out)
            if out.accepted or out.rejected or out.deltas or out.results or busy:
                out.snapshot = engine_snapshot(self.engine)
                self._send(out)
                out = EngineOutputs(time.perf_counter())

    def _send(self, out: EngineOutputs) -> None:
        self.push.send(self._enc.encode(out), copy=False)  # no HWM: never blocks

    def _handle(self, msg: EngineInputs, out: EngineOutputs) -> bool:
        engine = self.engine
        for add in msg.adds:
            try:
                engine.add_request(
                    add.prompt_token_ids,
                    add.params,
                    request_id=add.request_id,
                    priority=add.priority,
                    stream=add.stream,
                    cache_salt=add.cache_salt,
                )
            except KvCoreError as e:
                out.rejected.append((add.request_id, type(e).__name__, str(e)))
            except Exception as e:  # noqa: BLE001 - the request's failure, not the loop's
                log.exception("add_request failed")
                out.rejected.append((add.request_id, "EngineError", f"add_request failed: {e}"))
            else:
                self._sent[add.request_id] = [0] * add.params.n
                out.accepted.append((add.request_id, time.perf_counter()))
        for rid in msg.aborts:
            if rid in self._sent:
                with contextlib.suppress(UnknownRequestError):
                    self._deliver(engine.abort_request(rid), out)
        for call_id, name, args in msg.calls:
            self._calls_pending += 1
            if name in _INLINE:  # between steps, holding nothing
                self._call(call_id, name, args)
            else:
                threading.Thread(target=self._call, args=(call_id, name, args), daemon=True).start()
        return msg.shutdown

    def _step(self, out: EngineOutputs) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail its requests, keep serving
            log.exception("engine step failed")
            self._abort_all(out, f"engine step failed: {type(e).__name__}: {e}")
            return
        out.time = time.perf_counter()
        if self._step_log is not None:
            st = self.engine.stats
            self._step_log.write(f"{t0:.6f} {out.time - t0:.6f} {st.last_tokens} {st.last_seqs}\n")
        self._deliver(outputs, out)

    def _deliver(self, outputs: list[Any], out: EngineOutputs) -> None:
        """Token deltas of the outputs (cumulative snapshots) since the last ones sent."""
        for o in outputs:
            sent = self._sent.get(o.request_id)
            if sent is None:
                continue
            first = o.request_id not in self._scheduled
            d = RequestDelta(o.request_id, [c.token_ids[sent[c.index] :] for c in o.outputs])
            if any(c.logprobs is not None for c in o.outputs):
                d.logprobs = [list(c.logprobs or [])[sent[c.index] :] for c in o.outputs]
                if any(c.top_logprobs is not None for c in o.outputs):
                    d.top_logprobs = [
                        list(c.top_logprobs or [])[sent[c.index] :] for c in o.outputs
                    ]
            for c in o.outputs:
                sent[c.index] = len(c.token_ids)
            if first and any(d.token_ids) or o.finished:
                self._scheduled.add(o.request_id)
                d.num_cached_tokens = o.num_cached_tokens
                d.first_scheduled_time = o.metrics.first_scheduled_time
            if o.finished:
                d.finished = True
                d.finish_reasons = [c.finish_reason for c in o.outputs]
                d.stop_reasons = [c.stop_reason for c in o.outputs]
                d.token_times = list(o.metrics.token_times)
                d.error = o.error
                del self._sent[o.request_id]
                self._scheduled.discard(o.request_id)
            out.deltas.append(d)

    def _abort_all(self, out: EngineOutputs, error: str | None) -> None:
        for rid in list(self._sent):
            try:
                outs = self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - a broken engine: report without outputs
                outs = []
            for o in outs:
                o.error = o.error or error
            self._deliver(outs, out)
            if rid in self._sent:  # no final output came back: fail it by hand
                del self._sent[rid]
                self._scheduled.discard(rid)
                out.deltas.append(
                    RequestDelta(rid, [], finished=True, error=error or "the engine stopped")
                )

    # ---- utility calls (inline or a side thread) ---------------------------------------------

    def _call(self, call_id: int, name: str, args: list[Any]) -> None:
        try:
            result: Any = self._utility[name](*args)
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            result = {"error": f"{type(e).__name__}: {e}"}
        self._results.put((call_id, result))

    def _collect_results(self, out: EngineOutputs) -> None:
        while True:
            try:
                out.results.append(self._results.get_nowait())
            except queue.Empty:
                return
            self._calls_pending -= 1

    def _wait_published(self, timeout: float) -> bool:
        tiers = self.engine.tiers
        return bool(tiers.wait_published(timeout)) if tiers is not None else False

    def _figures(self) -> dict[str, float]:
        return self.engine.tier_figures()

    def _dashboard_view(self) -> dict[str, Any]:
        return engine_view(self.engine)  # thread-safe reads (the engine's state lock)


def main(in_addr: str, out_addr: str) -> int:
    """Entry of the engine process: build the engine, say ready, loop until ``shutdown``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front-end drains, then says shutdown
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    make_engine, args = pickle.loads(sys.stdin.buffer.read())
    ctx = zmq.Context(1)
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block on a front-end that stopped reading
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)
    try:
        engine = make_engine(args)
        ready = ("ready", {**engine_info(engine), "snapshot": engine_snapshot(engine)})
    except BaseException:  # noqa: BLE001 - the front-end prints it and exits
        push.send(pickle.dumps(("failed", traceback.format_exc())))
        push.close()
        return 1
    push.send(pickle.dumps(ready))
    EngineCoreProc(engine, pull, push).run()
    with contextlib.suppress(Exception):  # tier writes get a deadline: a hung store never holds
        engine.close(timeout_s=2.0)
    push.close()
    pull.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("KVCORE_ENGINE_LOG", "WARNING"))
    sys.exit(main(sys.argv[1], sys.argv[2]))
