"""CUDA graphs for decode-only steps: a ladder of captured batch sizes over static buffers.

A decode step of ``n`` requests is padded to the smallest captured size ``B >= n`` and replayed:
one launch instead of hundreds (vLLM's and SGLang's decode graphs, the idea of both). What a
graph reads lives at fixed addresses, in ``DecodeBuffers``::

    tokens    int64 [3, max_batch]                 input_ids, positions, slot_mapping
    requests  int32 [max_batch + max_batch * width]  seq_lens, then the block table's rows
                                                   (padded with 0), each a contiguous view
    query_start_loc int32 [max_batch + 1]          0, 1, 2, ... (one token per request)

The kernels take ``seq_lens`` and the block table's rows as contiguous int32 (a Triton kernel
reads ``seq_lens_ptr + i``): a column of a ``[max_batch, 1 + width]`` buffer read every
request's length from the wrong row on the GPU (the first H200 run, 2026-12-04).

Padding rows (``n <= row < B``) touch nothing: token 0 at position 0 stored at slot 0, which is
in the null block (``store_kv`` skips every slot ``< block_size``); ``seq_len`` 1 over a block
table of zeros, so attention reads one null-block key (zeros, finite) and their output rows are
dropped. The bookkeeping (ladder, padding, the step's metadata) is plain torch and runs on the
CPU, where tests check that a padded step gives the unpadded logits and writes no real block;
``CudaGraphs`` adds the capture and replay (CUDA only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from kvcore_kernels import AttentionMetadata

from kvcore.errors import InvalidArgumentError
from kvcore.runner.attention_op import attach_plan


def graph_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (which is always
    included), or the given ``sizes`` (sorted, deduplicated, each in ``[1, max_num_seqs]``)."""
    if sizes is None:
        ladder = [1, 2, 4] + list(range(8, max_num_seqs + 1, 8))
        sizes = [s for s in ladder if s <= max_num_seqs] + [max_num_seqs]
    out = sorted(set(int(s) for s in sizes))
    if not out or out[0] < 1 or out[-1] > max_num_seqs:
        raise InvalidArgumentError(f"graph sizes must lie in [1, {max_num_seqs}], got {sizes}")
    return out


class DecodeBuffers:
    """Static inputs of decode steps padded to a captured size (CPU or CUDA)."""

    def __init__(self, max_batch: int, width: int, block_size: int, device: torch.device):
        self.max_batch, self.width, self.block_size, self.device = (
            max_batch,
            width,
            block_size,
            device,
        )
        pin = device.type == "cuda"
        self.host_tokens = torch.zeros((3, max_batch), dtype=torch.int64, pin_memory=pin)
        size = max_batch * (1 + width)
        self.host_requests = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.tokens = torch.zeros((3, max_batch), dtype=torch.int64, device=device)
        self.requests = torch.zeros(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=device)  # logits_to_keep
        # NumPy views of the host staging (made once: fill runs every decode step)
        self._tok = self.host_tokens.numpy()
        self._lens, self._table = (t.numpy() for t in self._views(self.host_requests))

    def bucket(self, n: int, sizes: list[int]) -> int | None:
        """The smallest captured size that holds ``n`` requests (None: none does)."""
        i = int(np.searchsorted(sizes, n))
        return sizes[i] if i < len(sizes) else None

    def fits(self, plan: Any) -> bool:
        """Whether ``plan`` is a decode-only step these buffers can hold."""
        n = len(plan.seq_lens)
        return (
            0 < n <= self.max_batch
            and len(plan.input_ids) == n
            and plan.block_table.shape[1] <= self.width
        )

    def fill(self, plan: Any, batch: int) -> None:
        """Stage ``plan``'s rows and the padding rows up to ``batch``; copy them to the device
        (asynchronous from pinned memory on CUDA: two copies, no sync)."""
        n = len(plan.seq_lens)
        fits = len(plan.input_ids) == n and plan.block_table.shape[1] <= self.width
        if not fits or not n <= batch <= self.max_batch:
            raise InvalidArgumentError(f"a decode step of {n} rows does not fit batch {batch}")
        tok, lens, table = self._tok, self._lens, self._table
        tok[0, :n] = plan.input_ids
        tok[1, :n] = plan.positions
        tok[2, :n] = plan.slot_mapping
        tok[:, n:batch] = 0  # token 0 at position 0 into slot 0: the null block, never stored
        w = plan.block_table.shape[1]
        lens[:n] = plan.seq_lens
        table[:n, :w] = plan.block_table
        table[:n, w:] = 0
        lens[n:batch] = 1  # one key, in the null block
        table[n:batch] = 0
        self.tokens[:, :batch].copy_(self.host_tokens[:, :batch], non_blocking=True)
        used = self.max_batch + batch * self.width  # every length, then the used table rows
        self.requests[:used].copy_(self.host_requests[:used], non_blocking=True)

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_lens [max_batch], block table [max_batch, width]) views of ``flat``."""
        b = self.max_batch
        return flat[:b], flat[b:].view(b, self.width)

    def metadata(self, batch: int, max_seq_len: int | None = None) -> AttentionMetadata:
        """The step's metadata over the buffers' first ``batch`` rows (device views plus host
        copies of the staged values), attached to its ``seq_lens`` view for the custom op.
        ``max_seq_len``: the longest sequence the kernels should plan for (a graph is captured
        for the longest it will ever replay); default: the staged one."""
        lens = self._lens[:batch].astype(np.int64)
        table = self._table[:batch].astype(np.int64)
        dev_lens, dev_table = self._views(self.requests)
        meta = AttentionMetadata(
            num_reqs=batch,
            num_tokens=batch,
            block_size=self.block_size,
            max_q_len=1,
            max_seq_len=int(lens.max()) if max_seq_len is None else max_seq_len,
            max_block_id=int(table.max()),
            device=self.device,
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=dev_lens[:batch],
            block_table=dev_table[:batch],
            host_query_start_loc=np.arange(batch + 1, dtype=np.int64),
            host_seq_lens=lens,
            host_block_table=table,
        )
        attach_plan(meta.seq_lens, meta)
        return meta

    def inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids [1, B], positions [1, B], slot_mapping [B], logits rows [B]) views."""
        t = self.tokens[:, :batch]
        return t[0][None], t[1][None], t[2], self.rows[:batch]


class CudaGraphs:
    """Captured decode graphs, one per ladder size, sharing one memory pool (CUDA only).

    The protocol (capture-time metadata per size, refill the buffers, replay, slice the real
    rows) is plain Python; the CUDA parts are ``_begin`` / ``_record`` / ``_play`` / ``_end``,
    which a test's CPU stand-in replaces with eager runs to check the protocol without a GPU."""

    DEVICE_TYPE = "cuda"

    def __init__(self, buffers: DecodeBuffers, sizes: list[int]):
        if buffers.device.type != self.DEVICE_TYPE:
            raise InvalidArgumentError("CUDA graphs need a CUDA device")
        self.buffers, self.sizes = buffers, sizes
        self.graphs: dict[int, tuple[Any, Any]] = {}  # batch -> (what _record made, metadata)
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def capture(self, run: Callable[[int, Any], torch.Tensor], max_seq_len: int) -> None:
        """Capture ``run(batch, meta) -> logits [batch, vocab]`` for every size, largest first
        (smaller graphs reuse the largest one's pool). Each size's metadata is made here, once,
        with every row padding and planned for ``max_seq_len``; replays only refill the
        buffers it points at."""
        start = time.perf_counter()
        self._begin()
        for batch in reversed(self.sizes):
            self.buffers.fill(_EmptyPlan(), batch)
            meta = self.buffers.metadata(batch, max_seq_len=max_seq_len)
            self.graphs[batch] = (self._record(run, batch, meta), meta)  # meta: work lists
        self._end()
        self.capture_seconds = time.perf_counter() - start

    def replay(self, plan: Any) -> torch.Tensor | None:
        """Logits ``[n, vocab]`` of a decode-only ``plan`` (a view of the graph's output, valid
        until the next replay), or None when no captured graph holds it."""
        if not self.buffers.fits(plan):
            return None
        n = len(plan.seq_lens)
        batch = self.buffers.bucket(n, self.sizes)
        if batch is None:
            return None
        self.buffers.fill(plan, batch)
        return self._play(self.graphs[batch][0])[:n]

    def _begin(self) -> None:
        torch.cuda.synchronize()
        self._before = torch.cuda.memory_reserved()
        self._pool = torch.cuda.graph_pool_handle()

    def _record(self, run: Callable[[int, Any], torch.Tensor], batch: int, meta: Any) -> Any:
        """Run twice off the default stream (compiles the shape, builds the kernels' cached
        work lists, so the capture itself copies nothing), then capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                run(batch, meta)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run(batch, meta)
        return graph, out

    def _play(self, recorded: Any) -> torch.Tensor:
        graph, out = recorded
        graph.replay()
        return out

    def _end(self) -> None:
        torch.cuda.synchronize()
        self.memory_bytes = torch.cuda.memory_reserved() - self._before


class _EmptyPlan:
    """A decode step with no rows: every row of the batch is padding (used for capture)."""

    input_ids = positions = slot_mapping = seq_lens = np.zeros(0, np.int64)
    block_table = np.zeros((0, 0), np.int64)
