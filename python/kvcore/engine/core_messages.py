"""The messages between the server's front-end process and the engine-core process.

One ``EngineInputs`` per event-loop turn of the front-end (the adds and aborts of that turn) and
one ``EngineOutputs`` per engine step (token ids only, for every request that grew), each a
msgpack frame (msgspec) on a zmq PUSH/PULL pair over ipc. Structs are ``array_like`` (no field
names on the wire). Text never crosses: the front-end tokenizes, detokenizes and matches stop
strings; the engine sees token ids and ``SamplingParams`` without stop strings.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcore.params import SamplingParams


class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request for the engine (``params`` carry no stop strings: the front-end's job)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    stream: bool = True  # False: only the final output comes back


class EngineInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Front-end → engine: everything one event-loop turn produced."""

    adds: list[AddRequest] = []
    aborts: list[str] = []
    calls: list[tuple[int, str, list[Any]]] = []  # (call id, utility name, args)
    shutdown: bool = False


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in one step: new token ids (and logprobs) per sample."""

    request_id: str
    token_ids: list[list[int]]  # per sample, the tokens since the last delta
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[dict[int, float]]] | None = None
    finished: bool = False
    finish_reasons: list[str | None] | None = None  # with finished
    stop_reasons: list[int | str | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] | None = None  # with finished: sample 0's token times
    error: str | None = None  # a failed step or engine aborted it


class EngineOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine → front-end: one per step (or per batch of inputs handled while idle)."""

    time: float  # the engine's perf_counter when the step's tokens were recorded
    accepted: list[tuple[str, float]] = []  # (request id, arrival time in the engine)
    rejected: list[tuple[str, str, str]] = []  # (request id, error class, message)
    deltas: list[RequestDelta] = []
    snapshot: dict[str, Any] | None = None
    results: list[tuple[int, Any]] = []  # (call id, result) of utility calls
    bye: bool = False  # the engine has shut down (its last message)


def encoder() -> msgspec.msgpack.Encoder:
    """A reusable encoder (one per socket owner)."""
    return msgspec.msgpack.Encoder()


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """A reusable decoder for ``EngineInputs`` or ``EngineOutputs``."""
    return msgspec.msgpack.Decoder(kind)
