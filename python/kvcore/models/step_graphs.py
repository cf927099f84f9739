"""A small step's layers after the first replayed from their recorded native calls (CPU, eager).

Under ``cpu_native.deferred`` the middle layers of a small step record their native calls and
run them in one crossing (docs/engine.md, "Deferred native calls"); building those records is
still ~136 us of Python per layer, every step. Consecutive decode steps make the same calls on
the same weights and caches: only the step's inputs (the hidden state and residual after the
first layer, the rotary ``cos, sin``) and its attention metadata and slots change. So, as a
CUDA graph does for a GPU step (vLLM captures one per batch size), ``StepGraphs`` keeps the
record of one step per row count (``cpu_native.captured``) and runs it again
(``StepGraph.replay``): the inputs copied into the tensors the capture read, the step's arrays
patched into the attention and store records, one ``run_calls``. No Python of the layers runs.
The caller names what its body computes (``tag``): ``LlamaModel`` replays layers 1 to the last
where every row is sampled (decode steps), else the middle layers only.

A row count is captured on its second step in a row (a batch that changes every step keeps
recording as before), and only where the step's ``replay_key()`` says its layers all go straight
to the native store and kernel (no KV groups, no H2O mass, no probes, a plain CPU cache). The
capture itself refuses a block in which torch ran an op or a flush ran part of the calls
(``Capture.why``), and that key then records as before. Graphs hold their intermediates:
~8.4 KB per row per layer for SmolLM2 in bf16, so their rows are capped (``MAX_ROWS``, least
recently used out first; ``MAX_GRAPHS`` of them at most), and a capture over other caches
drops the graphs of the old ones. ``KVCORE_STEP_GRAPHS=0`` turns replay off.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from kvcore_kernels import cpu_native

# Rows of all graphs kept together (SmolLM2 bf16: ~4.3 MB per 16 rows over its 28 middle layers)
MAX_ROWS = 512
MAX_GRAPHS = 8

Tensors = tuple[torch.Tensor, ...]


def enabled() -> bool:
    """``KVCORE_STEP_GRAPHS`` is not ``0`` (read per call: tests flip it)."""
    return os.environ.get("KVCORE_STEP_GRAPHS", "1") not in ("0", "")


class _Entry:
    __slots__ = ("graph", "inputs", "outputs")

    def __init__(self, graph: cpu_native.StepGraph, inputs: Tensors, outputs: Tensors):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class StepGraphs:
    """One model's captured steps, keyed by row count, dtype, threads, the native options and
    the step's ``replay_key()``. ``run(step, inputs, body)`` returns ``body(*inputs)``'s
    outputs, computed by replay where a graph fits, else by ``body`` under
    ``cpu_native.deferred`` (capturing it where the key repeats)."""

    def __init__(self, max_rows: int | None = None):
        self.max_rows = MAX_ROWS if max_rows is None else max_rows
        self._graphs: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._last: Hashable | None = None  # the key of the step before
        self._refused: set[Hashable] = set()  # keys whose capture was refused
        self.replays = 0  # counters, for tests and benchmarks
        self.captures = 0

    def clear(self) -> None:
        self._graphs.clear()
        self._last = None
        self._refused.clear()

    def run(
        self, step: Any, inputs: Tensors, body: Callable[..., Tensors], tag: Hashable = None
    ) -> Tensors:
        """``tag``: what ``body`` computes, where a caller has several bodies (here: the
        layers it runs)."""
        key = self._key(step, inputs, tag)
        if key is None:
            with cpu_native.deferred():
                return body(*inputs)
        meta, slots = step.replay_args()
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            for dst, src in zip(entry.inputs, inputs, strict=True):
                dst.copy_(src)
            if entry.graph.replay(meta, slots):
                self.replays += 1
                self._last = key
                return entry.outputs
            del self._graphs[key]  # a step that does not fit it: record this one
        if key != self._last or key in self._refused or key[0] > self.max_rows:
            self._last = key
            with cpu_native.deferred():
                return body(*inputs)
        own = tuple(t.clone() for t in inputs)  # the graph's own inputs, rewritten per replay
        with cpu_native.captured(meta, slots) as cap:
            outputs = body(*own)
        if cap.graph is None:
            if len(self._refused) >= 64:
                self._refused.clear()
            self._refused.add(key)
            return outputs
        self.captures += 1
        for other in [k for k in self._graphs if k[-1] != key[-1]]:
            del self._graphs[other]  # other caches: those steps are over (and held by it)
        self._graphs[key] = _Entry(cap.graph, own, tuple(outputs))
        while len(self._graphs) > 1 and (
            len(self._graphs) > MAX_GRAPHS or sum(k[0] for k in self._graphs) > self.max_rows
        ):
            self._graphs.popitem(last=False)  # least recently used first
        return outputs

    @staticmethod
    def _key(step: Any, inputs: Tensors, tag: Hashable) -> tuple | None:
        if not enabled() or torch.compiler.is_compiling():
            return None
        replay_key = getattr(step, "replay_key", None)
        own = replay_key() if replay_key is not None else None
        if own is None:
            return None
        h = inputs[0]
        return (
            h.shape[0], h.dtype, torch.get_num_threads(), cpu_native.options_key(),
            tuple((t.shape, t.dtype, t.stride()) for t in inputs), tag, own,
        )  # fmt: skip
