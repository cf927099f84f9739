"""KV tiers below the block pool: L2 host memory, L3 local disk, L4 a shared Redis.

The Rust core decides every move (see ``rust/src/tiers/mod.rs``); this package moves bytes:

- ``TierManager.apply(plan)`` (the model runner calls it before ``copy_ops``): publish reads
  (newly computed L1 blocks, written through to L3 and L4 in the background), offloads
  (L1 -> L2 slots), loads (L2 -> L1), then starts the plan's fetches.
- ``TierManager.before_schedule(scheduler)`` (the engine calls it before each ``schedule()``):
  collects finished or timed-out fetches, hands them to ``Scheduler.tier_fetched`` and writes
  the arrived blocks into the L2 slots it returns; updates the swap cost model's measurements.

A block's bytes are its row in every layer's cache, in the cache's own storage format: the
plain ``[num_blocks, 2, block_size, heads, dim]`` tensor viewed as bytes, or a quantized
cache's ``buffer`` rows (codes and scales together). L2 is a ``[host_blocks, row_bytes]``
uint8 tensor per layer (pinned when the cache is on CUDA).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np
import torch
from kvcore_kernels.quant import QuantKVCache

from kvcore._kvcore import copy_block_rows
from kvcore.errors import InvalidArgumentError
from kvcore.tiers.codec import BlockCodec
from kvcore.tiers.io import IoPool
from kvcore.tiers.stores import DiskStore, RedisStore

__all__ = [
    "BlockCodec",
    "DiskStore",
    "FetchJob",
    "RedisStore",
    "TierManager",
    "model_fingerprint",
]

log = logging.getLogger("kvcore")


def model_fingerprint(model: Any) -> str:
    """A digest of a model's config, dtype and a sample of every parameter (so two random
    models with the same config but different seeds differ)."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    h.update(str(model.dtype).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    return h.hexdigest()


def layer_rows(cache: Any) -> torch.Tensor:
    """One layer's cache as ``[num_blocks, row_bytes]`` uint8 rows (a view, no copy)."""
    if isinstance(cache, QuantKVCache):
        if cache.residual_state is not None:
            raise InvalidArgumentError("KV tiers do not support KIVI formats (residual pools)")
        return cache.buffer
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` viewed with the widest integer dtype that divides a row: indexed copies of
    int64 rows run several times faster than of uint8 rows on the CPU."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if rows.shape[1] % size == 0 and rows.is_contiguous():
            return rows.view(dtype)
    return rows


def percentile_ms(values: list[float], q: float) -> float:
    """The ``q`` percentile of ``values`` (seconds) in ms; nan when empty."""
    return float(np.percentile(values, q) * 1e3) if values else float("nan")


class FetchJob:
    """One step's fetches from L3/L4, read on an I/O thread sequence by sequence. ``results``
    (kv id -> blocks) fills as each sequence is read; ``progress`` is when the job was
    submitted, started or last finished a sequence, so that a large batch that keeps moving is
    waited for and only one that stalls for ``fetch_timeout_s`` turns into misses."""

    def __init__(self, now: float, wake: threading.Event | None = None):
        self.results: dict[int, list[tuple[bytes, int]]] = {}
        self.progress = now
        self.finished = False
        self.wake = wake  # set on every sequence read and at the end (the engine waits on it)

    def moved(self, finished: bool = False) -> None:
        self.progress = time.perf_counter()
        self.finished = self.finished or finished
        if self.wake is not None:
            self.wake.set()


class TierManager:
    """Moves KV bytes between the pool, host memory, disk and Redis as the StepPlan says."""

    def __init__(
        self,
        kv_caches: list[Any],
        host_blocks: int,
        codec: BlockCodec,
        *,
        disk: DiskStore | None = None,
        remote: RedisStore | None = None,
        fetch_timeout_s: float = 5.0,
        io_threads: int = 4,
    ):
        self.layers = [_wide(layer_rows(c)) for c in kv_caches]
        self.device = self.layers[0].device
        self.bounds = np.cumsum([0] + [r.view(torch.uint8).shape[1] for r in self.layers]).tolist()
        self.block_bytes = int(self.bounds[-1])
        pin = self.device.type == "cuda"
        # L2: one [host_blocks, row_bytes] tensor per layer (contiguous rows per copy).
        self.host = [
            torch.zeros((host_blocks, r.shape[1]), dtype=r.dtype, pin_memory=pin)
            for r in self.layers
        ]
        # CPU: loads and offloads copy each row once, in Rust, through NumPy views (no copy).
        self._np = None
        if self.device.type == "cpu":
            self._np = (
                [r.view(torch.uint8).numpy() for r in self.layers],
                [h.view(torch.uint8).numpy() for h in self.host],
            )
        # One thread: loads and offloads run right after a forward, while torch's OpenMP
        # workers still spin; threads of our own then share the cores with them (measured in
        # the engine: 2.7 GB/s with 2 threads, 7.8 GB/s with 1; docs/tiers.md, "Every
        # configuration in one run").
        self.copy_threads = 1
        self.codec, self.disk, self.remote = codec, disk, remote
        self.fetch_timeout_s = fetch_timeout_s
        # Daemon threads: a read that never returns (hung mount, stalled socket) cannot keep
        # the process from exiting; close() waits for them only up to its deadline.
        self.io = IoPool(io_threads, "kvcore-tier")
        self._fetch_moved = threading.Event()  # a fetch job read a sequence or ended
        self._applied: tuple[int, set[str]] = (-1, set())  # step id, its one-time parts done
        self._closed = False
        self._fetches: dict[int, tuple[FetchJob, float]] = {}  # kv id -> (its step's job, start)
        self.fetch_reads = 0  # distinct keys read from L3/L4 (fetches share reads per step)
        self._publishing: list[Future] = []  # write-throughs not yet known to be done
        self.bytes_offloaded = self.bytes_loaded = self.bytes_published = 0
        self.load_seconds = 0.0
        self.load_latency_s: list[float] = []  # per step that loads from L2
        self.fetch_latency_s: list[float] = []  # per fetch from L3/L4
        self.tier_hit_tokens = {3: 0, 4: 0}
        self.tokens_computed = 0
        self.forward_seconds = 0.0

    # ---- moves in a step --------------------------------------------------------------

    def gather(self, blocks: np.ndarray) -> torch.Tensor:
        """``[n, block_bytes]`` host bytes of L1 blocks (every layer's row, in layer order)."""
        idx = torch.as_tensor(np.asarray(blocks, np.int64), device=self.device)
        parts = [rows.index_select(0, idx).cpu().view(torch.uint8) for rows in self.layers]
        return torch.cat(parts, dim=1)

    def apply(self, plan: Any) -> None:
        """The plan's tier moves, in order: publish reads, offloads, loads; then its fetches."""
        io = plan.tier_io
        # A step run again after a failed forward (LLMEngine) redoes its copies (idempotent)
        # but not its write-throughs, fetches and counts.
        if self._applied[0] != plan.step_id:
            self._applied = (plan.step_id, set())
        done = self._applied[1]
        if "count" not in done:
            self.tokens_computed += int(plan.num_tokens)
            done.add("count")
        if len(io.publish) and "publish" not in done:
            done.add("publish")  # write-through of newly computed blocks to L3 and L4
            data = self.gather(io.publish).numpy()
            self.bytes_published += data.nbytes
            keys, toks = io.publish_keys.copy(), io.publish_tokens.copy()
            self._publishing = [f for f in self._publishing if not f.done()]
            self._publishing.append(self.io.submit(self._publish, keys, toks, data))
        off = plan.tier_offload
        if len(off):
            self._copy(np.asarray(off), to_host=True)
            self.bytes_offloaded += len(off) * self.block_bytes
        load = plan.tier_load
        if len(load):
            start = time.perf_counter()
            self._copy(np.asarray(load), to_host=False)
            dt = time.perf_counter() - start
            self.load_seconds += dt
            self.load_latency_s.append(dt)
            self.bytes_loaded += len(load) * self.block_bytes
        if len(io.fetch_seqs) and "fetch" not in done:  # one job for the step's fetches
            done.add("fetch")
            offsets = io.fetch_offsets
            wants = [
                (
                    kv_id,
                    io.fetch_keys[offsets[i] : offsets[i + 1]].copy(),
                    io.fetch_tokens[offsets[i] : offsets[i + 1]].copy(),
                )
                for i, kv_id in enumerate(io.fetch_seqs.tolist())
            ]
            job = FetchJob(time.perf_counter(), self._fetch_moved)
            if self.io.submit(self._run_fetch, job, wants).cancelled():
                job.moved(finished=True)  # closed: every fetch is a miss
            for kv_id, _, _ in wants:
                self._fetches[kv_id] = (job, job.progress)

    def _copy(self, pairs: np.ndarray, to_host: bool) -> None:
        """Rows ``pairs[:, 0]`` -> ``pairs[:, 1]`` of every layer: pool -> L2 (``to_host``) or
        L2 -> pool. CPU: one pass per row in Rust (``copy_block_rows``; a torch gather then
        scatter copies each byte twice). CUDA: a host gather, one transfer, a device scatter."""
        if self._np is not None:
            pool, host = self._np
            dst, src = (host, pool) if to_host else (pool, host)
            copy_block_rows(dst, src, pairs, threads=self.copy_threads)
            return
        src = torch.as_tensor(pairs[:, 0].astype(np.int64))
        dst = torch.as_tensor(pairs[:, 1].astype(np.int64))
        if to_host:
            src = src.to(self.device)
            for rows, host in zip(self.layers, self.host, strict=True):
                host.index_copy_(0, dst, rows.index_select(0, src).cpu())
            return
        dst = dst.to(self.device)
        for rows, host in zip(self.layers, self.host, strict=True):
            rows.index_copy_(0, dst, host.index_select(0, src).to(self.device, non_blocking=True))
        torch.cuda.synchronize(self.device)

    def _publish(self, keys: np.ndarray, toks: np.ndarray, rows: np.ndarray) -> None:
        items = [
            (k.tobytes().hex(), self.codec.encode(k.tobytes(), t, row.tobytes()))
            for k, t, row in zip(keys, toks, rows, strict=True)
        ]
        if self.disk is not None:
            for name, value in items:
                self.disk.put(name, value)
        if self.remote is not None:
            self.remote.put_many(items)

    def _run_fetch(self, job: FetchJob, wants: list) -> None:
        job.progress = time.perf_counter()  # started: the wait in the I/O queue is not a stall
        try:
            self._fetch_batch(wants, job)
        except Exception as e:  # a failed fetch is a miss (the stores count their own errors)
            log.debug("kvcore: tier fetch failed: %r", e)
        finally:
            job.moved(finished=True)

    def _fetch_batch(
        self, wants: list[tuple[int, np.ndarray, np.ndarray]], job: FetchJob | None = None
    ) -> dict:
        """Per sequence ``kv_id``, in order: the leading blocks of its keys found in L3, then
        L4, as ``[(payload, tier)]``, published to ``job.results`` as soon as that sequence is
        read (the scheduler admits it at the next step while later ones are still read). Each
        distinct key is read at most once per tier per batch (sequences that share a system
        prompt ask for the same blocks): L3 block by block, L4 in one ``MGET`` per sequence
        of the keys no earlier sequence asked for."""
        disk: dict[str, bytes | None] = {}
        remote: dict[str, bytes | None] = {}
        out = job.results if job is not None else {}
        for kv_id, keys, toks in wants:
            got: list[tuple[bytes, int]] = []
            names = [k.tobytes().hex() for k in keys]
            if self.disk is not None:
                for name, k, t in zip(names, keys, toks, strict=True):
                    if name not in disk:
                        self.fetch_reads += 1
                        value = self.disk.get(name)
                        disk[name] = self.codec.decode(value, k.tobytes(), t, self.block_bytes)
                    if disk[name] is None:
                        break
                    got.append((disk[name], 3))
            if self.remote is not None and len(got) < len(keys):
                rest = range(len(got), len(keys))
                need = list(dict.fromkeys(names[i] for i in rest if names[i] not in remote))
                if need:
                    self.fetch_reads += len(need)
                    values = dict(zip(need, self.remote.get_many(need), strict=True))
                    for i in rest:
                        if names[i] in values and names[i] not in remote:
                            remote[names[i]] = self.codec.decode(
                                values[names[i]], keys[i].tobytes(), toks[i], self.block_bytes
                            )
                for i in rest:
                    if remote.get(names[i]) is None:
                        break
                    got.append((remote[names[i]], 4))
            out[kv_id] = got  # whole: the scheduler never sees a sequence half read
            if job is not None:
                job.moved()
        return out

    # ---- between steps ----------------------------------------------------------------

    @property
    def num_fetching(self) -> int:
        """Fetches in flight."""
        return len(self._fetches)

    def fetched(self, job: FetchJob, kv_id: int, now: float) -> list | None:
        """``kv_id``'s blocks once its job read them; None while it is still to be read and the
        job moves; ``[]`` (a miss) when the job failed or stalled for ``fetch_timeout_s``."""
        got = job.results.get(kv_id)
        if got is None and (job.finished or now - job.progress > self.fetch_timeout_s):
            return []
        return got

    def before_schedule(self, scheduler: Any, forward_seconds: float) -> None:
        """Hands finished (or timed-out: a miss) fetches to the scheduler and fills their L2
        slots; refreshes the swap cost model."""
        self._fetch_moved.clear()  # what moves after this look wakes wait_fetch()
        now = time.perf_counter()
        done: list[tuple[int, list[tuple[bytes, int]]]] = []
        for kv_id, (job, start) in list(self._fetches.items()):
            got = self.fetched(job, kv_id, now)
            if got is None:
                continue
            done.append((kv_id, got))
            self.fetch_latency_s.append(now - start)
            del self._fetches[kv_id]
        if done:
            offsets, slots = scheduler.tier_fetched(
                np.asarray([d[0] for d in done], np.int64),
                np.asarray([len(d[1]) for d in done], np.int64),
            )
            for i, (_, got) in enumerate(done):
                for j, slot in enumerate(slots[offsets[i] : offsets[i + 1]].tolist()):
                    payload, tier = got[j]
                    self.tier_hit_tokens[tier] += self.codec.block_size
                    if slot >= 0:
                        row = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                        for host, a, b in zip(
                            self.host, self.bounds[:-1], self.bounds[1:], strict=True
                        ):
                            host[slot].view(torch.uint8).copy_(row[a:b])
        if self.load_seconds > 0 and self.tokens_computed:
            scheduler.set_tier_costs(
                self.bytes_loaded / self.load_seconds, forward_seconds / self.tokens_computed
            )

    def wake(self) -> None:
        """Ends a ``wait_fetch`` now (a new request arrived)."""
        self._fetch_moved.set()

    def wait_fetch(self, max_wait_s: float = 0.1) -> None:
        """Sleeps until a fetch job moves (reads a sequence, ends), ``wake()``, the earliest
        fetch's stall deadline, or ``max_wait_s``: an engine with nothing to run but fetches
        waits here instead of spinning empty steps."""
        if not self._fetches:
            return
        now = time.perf_counter()
        due = min(job.progress for job, _ in self._fetches.values()) + self.fetch_timeout_s
        self._fetch_moved.wait(min(max_wait_s, max(0.0, due - now) + 1e-3))

    def wait_published(self, timeout: float | None = None) -> bool:
        """Waits for the write-throughs submitted so far (any thread); True if all finished."""
        _, pending = wait_futures(list(self._publishing), timeout=timeout)
        return not pending

    def figures(self, scheduler: Any) -> dict[str, float]:
        """Per-tier statistics for reports (hit tokens, bytes each way, latencies, swaps)."""
        st = scheduler.tier_stats()
        return {
            "tier_l1_hit_tokens": st["l1_hit_tokens"],
            "tier_l2_hit_tokens": st["l2_hit_tokens"],
            "tier_l3_fetched_tokens": self.tier_hit_tokens[3],
            "tier_l4_fetched_tokens": self.tier_hit_tokens[4],
            "tier_bytes_offloaded": self.bytes_offloaded,
            "tier_bytes_loaded": self.bytes_loaded,
            "tier_bytes_published": self.bytes_published,
            "tier_load_p50_ms": percentile_ms(self.load_latency_s, 50),
            "tier_load_p95_ms": percentile_ms(self.load_latency_s, 95),
            "tier_fetch_p50_ms": percentile_ms(self.fetch_latency_s, 50),
            "tier_fetch_p95_ms": percentile_ms(self.fetch_latency_s, 95),
            "tier_fetch_reads": self.fetch_reads,
            "tier_swap_outs": st["swap_outs"],
            "tier_swap_ins": st["swap_ins"],
            "tier_host_evictions": st["host_evictions"],
            "tier_disk_failures": self.disk.failures if self.disk else 0,
            "tier_remote_failures": self.remote.failures if self.remote else 0,
            "tier_auth_failures": self.codec.auth_failures,
        }

    def close(self, timeout_s: float = 5.0) -> bool:
        """Waits up to ``timeout_s`` for background writes, then stops the I/O threads; True
        if all finished. A tier that never answers (hung mount, stalled Redis) leaves its
        daemon threads behind, logged once, and never holds the process."""
        if self._closed:
            return True
        self._closed = True
        ok = self.io.shutdown(timeout_s)
        if not ok:
            log.warning(
                "kvcore: tier I/O still blocked after %.1f s at close; abandoned (a hung disk "
                "or store: its writes are lost, nothing else is)",
                timeout_s,
            )
        return ok
