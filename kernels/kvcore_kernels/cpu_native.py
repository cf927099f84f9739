"""The native CPU paged attention (Rust, ``kvcore_kernels._native``): loading, threads, work list.

The kernel (``kernels/native/src``) reads K and V in place through the block table: no gather,
no padding to zero. Its unit of work (one task) is an *item*: one request, a run of up to
``PREFILL_ITEM_ROWS // group`` of its query tokens, and a key range, for every KV head in turn
over each tile of 16 keys (a token's heads are adjacent in the cache, so an item streams through
its blocks once), with all the query heads of a KV head as rows of one online softmax: each K/V
row is read once per item.
When a step has too few items to keep the threads busy (batch 1, long context), an item's key
range is cut into splits whose partial results a second pass merges (flash-decoding)::

    request r:  ctx = seq_len - q_len      queries at positions ctx .. seq_len-1
    item:       tokens tok0 .. tok0+ntok-1 of r, keys [key_lo, key_hi)
                key_lo = first query's window start (0 without a window), key_hi = last pos + 1
    split s:    keys [key_lo + s * span, key_lo + (s+1) * span) of the item, partials merged

Decode requests that share cached prefix blocks (the radix cache hands a common system prompt's
blocks to every request) get a *cascade* item: their query tokens, consecutive in the step, are
the rows of one item over the shared keys, so those K/V rows are read once per run of up to
``ITEM_ROWS // group`` requests instead of once per request; each request's own keys are a
second item, and the two partials are merged like splits (FlashInfer's cascade attention)::

    cascade:    requests r0 .. r0+n-1 (one query token each), keys [0, shared)
    own:        request r, keys [shared, seq_len[r]); merged with its row of the cascade item

``work_for`` builds the items once per step and configuration (cached in the metadata, like the
twin's chunks); a layer's call then costs one FFI call with the tensors' addresses.

Threads: by default the kernel runs on torch's own OpenMP team (the address of ``GOMP_parallel``
in the libgomp torch loaded is handed to the extension), with ``torch.get_num_threads()``
threads, so it never competes with torch's spinning workers. ``KVCORE_NATIVE_THREADS`` =
``omp`` | ``rayon`` | ``single`` picks another mode (docs/kernels.md has the measurements).
The code path is the best this CPU has: AVX-512 (with BF16 dot products where it has them),
else AVX2 + FMA, else portable; ``KVCORE_NATIVE_ISA=avx2`` caps it at AVX2 and
``KVCORE_NATIVE_PORTABLE=1`` (or ``KVCORE_NATIVE_ISA=portable``) forces the portable one;
``KVCORE_NATIVE_CASCADE=0`` turns cascade items off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils._python_dispatch

from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata

ITEM_ROWS = 48  # query rows (tokens x GQA group) of a cascade item: the scratch stays in L1/L2
# Query rows of an item of a prefill chunk (at most 256 tokens: the kernel's per-item limit).
# Larger items share each K/V tile's set-up (block-table walk, K conversion, V re-lay, masks)
# over more 16-row blocks: 1 x 256 / 1K prefill, one thread, AVX-512 BF16 (Zen 4), 48 -> 192
# rows: 0.77 -> 0.65 ms, 10.6 -> 8.9-9.4 ms (benches/bench_attention.py --sweep); AVX2 alike.
PREFILL_ITEM_ROWS = 192
TASKS_PER_THREAD = 4  # split long key ranges until a step has this many tasks per thread
MIN_SPLIT_KEYS = 512  # ... but never into splits shorter than this
MAX_SPLITS = 64
MIN_CASCADE_KEYS = 64  # a shared prefix shorter than this is read per request
# Groups of 2 requests and up: bench_cascade_cpu.py (GQA 9/3, 512 shared keys) measured the
# cascade 1.03x at 2 requests (1 thread), 1.05-1.17x at 3-6, 1.26-1.30x at 8, 1.35-1.58x at 16-48.
MIN_CASCADE_REQUESTS = 2
MODES = {"single": 0, "omp": 1, "rayon": 2}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FMT_F32, FMT_BF16, FMT_F16, FMT_INT8, FMT_E4M3, FMT_E5M2 = range(6)

try:  # the compiled extension (not a Python module of the layer table)
    _native = importlib.import_module("kvcore_kernels._native")
except ImportError:  # a build without the extension: every caller falls back to the twin
    _native = None


# Op codes of ``_native.run_calls``' records.
_CALL_LINEAR, _CALL_ELEMENTWISE, _CALL_STORE, _CALL_ATTENTION = range(4)


class _Recording:
    """Native calls held back by ``deferred``: their argument records, in order, and whatever
    their addresses point into (kept alive until the calls have run). For ``captured``, also
    where each attention and store record depends on the step (its metadata, its slots), and
    whether a ``flush`` ran part of them before the end."""

    __slots__ = ("attention", "calls", "flushed", "keep", "owner", "stores")

    def __init__(self) -> None:
        self.owner = threading.get_ident()  # other threads' calls run at once, unrecorded
        self.calls: list[tuple[int, list[int], list[float]]] = []
        self.keep: list[object] = []
        # (ints, meta, window, num_kv_heads, group, head_dim, alibi, fuse) per attention call
        self.attention: list[tuple] = []
        self.stores: list[tuple[list[int], torch.Tensor]] = []  # (ints, int64 slots)
        self.flushed = False


_RECORDING: _Recording | None = None


def _rec() -> _Recording | None:
    """The recording this thread's native calls go to (None: they run at once)."""
    rec = _RECORDING
    return rec if rec is not None and rec.owner == threading.get_ident() else None


# Steps of up to this many rows defer their layers' calls (``deferred``): the recorded calls
# keep every intermediate alive until they run: ~8.4 KB per row per layer of SmolLM2 (bf16
# qkv, attention, o_proj, gated gate-up and down outputs), ~60 MB for 256 rows x 28 layers.
DEFER_MAX_ROWS = 256


def defer_allowed(rows: int) -> bool:
    """Whether a step of ``rows`` rows may defer its native calls: the extension is here, the
    step is small enough (``DEFER_MAX_ROWS``), and ``KVCORE_DEFER_CALLS`` is not ``0`` (read
    once, for A/B runs)."""
    return _native is not None and rows <= DEFER_MAX_ROWS and _defer_on()


@functools.cache
def _defer_on() -> bool:
    return os.environ.get("KVCORE_DEFER_CALLS", "1") not in ("0", "")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside, ``linear``, ``elementwise``, ``store`` and ``run`` record their calls instead of
    making them; at the end (or at ``flush()``) ``_native.run_calls`` checks and runs them all
    in order, in one crossing with the GIL released once. The Python that builds a step's
    ~270 calls then runs once on warm caches instead of between the kernels' weight and KV
    streams, where it cost 0.7-0.9 s of the offline SmolLM2 job (docs/engine.md, "Where the
    rest of the gap sits"). Their outputs are not written until then: code inside that reads
    one (a torch op, a fallback) calls ``flush()`` first. Nested, the outer block runs them; on
    an exception the recorded calls are dropped unrun (the tensors they write are the failed
    step's own)."""
    global _RECORDING
    if _RECORDING is not None or _native is None:
        yield
        return
    _RECORDING = _Recording()
    try:
        yield
        flush()
    finally:
        _RECORDING = None


def flush() -> None:
    """Run the calls ``deferred`` has recorded so far (no-op outside it or with none). A record
    its single call would refuse (a bad code, a slot past the cache) raises
    ``KernelConfigError`` with none of them run."""
    rec = _rec()
    if rec is None or not rec.calls:
        return
    calls, keep = rec.calls, rec.keep
    rec.calls, rec.keep = [], []
    rec.flushed = True
    try:
        _native.run_calls(calls)
    except ValueError as err:
        raise KernelConfigError(str(err)) from None
    del keep


def recording() -> bool:
    """Whether this thread's native calls are being recorded (inside ``deferred``)."""
    return _rec() is not None


class StepGraph:
    """A step's recorded native calls kept to run again for later steps of the same shape: the
    CPU's counterpart of a CUDA graph (vLLM's idea of capturing a decode step once and
    replaying it), made by ``captured``.

    Every address in the records points into tensors the graph keeps (the capture step's
    intermediates and inputs, the weights, the KV caches), except the step's own arrays:
    ``replay(meta, slots)`` rewrites those (each attention record's work list, sequence lengths
    and block table from ``work_for(meta, ...)``, each store record's slots) and runs the list
    in one crossing, with the same checks as any ``run_calls``. The caller copies the step's
    inputs into the tensors the capture read them from first, and reads the outputs from the
    tensors the capture wrote them to; a replay writes exactly what the recorded calls wrote.
    """

    __slots__ = ("attention", "calls", "keep", "rows", "stores")

    def __init__(self, rec: _Recording, rows: int) -> None:
        for ints, *_ in rec.attention:  # the positions ``replay`` rewrites are these records'
            assert len(ints) == _ATTENTION_INTS, len(ints)
        for ints, _ in rec.stores:
            assert len(ints) == _STORE_INTS, len(ints)
        self.calls = rec.calls
        self.keep = rec.keep
        self.attention = [(a[0], *a[2:]) for a in rec.attention]
        self.stores = [ints for ints, _ in rec.stores]
        self.rows = rows  # the slots a store record writes

    def replay(self, meta: AttentionMetadata, slots: torch.Tensor) -> bool:
        """Run the calls for the step of ``meta`` and ``slots`` (int64, contiguous, one per
        row). False, with nothing run, where the step does not fit the records (another row
        count, an attention call with no work); ``KernelConfigError`` where the native checks
        refuse a record (nothing run either)."""
        if slots.dtype != torch.int64 or not slots.is_contiguous() or slots.numel() != self.rows:
            return False
        threads = torch.get_num_threads()
        values, by_config = [], {}  # layers of one configuration share a work list
        for _ints, *config in self.attention:
            vals = by_config.get(tuple(config))
            if vals is None:
                window, hk, group, d, alibi, fuse = config
                work = work_for(meta, window, hk, group, d, threads, alibi=alibi, fuse=fuse)
                if len(work.work) == 0:  # ``run`` would not have made the call
                    return False
                vals = by_config[tuple(config)] = _step_ints(meta, work)
            values.append(vals)
        for (ints, *_), vals in zip(self.attention, values, strict=True):
            for i, v in zip(_STEP_INTS, vals, strict=True):
                ints[i] = v
        address = slots.data_ptr()
        for ints in self.stores:
            ints[_STORE_SLOTS] = address
        _bind_openmp()
        try:
            _native.run_calls(self.calls)
        except ValueError as err:
            raise KernelConfigError(str(err)) from None
        return True


# aten ops that neither read nor write a tensor's values: the only ones a captured block may
# run besides the recorded native calls (anything else would not be in the replayed list)
_INERT_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
        "_unsafe_view", "reshape", "slice", "select", "narrow", "unsqueeze", "squeeze",
        "t", "transpose", "permute", "as_strided", "expand", "alias", "detach", "split",
        "split_with_sizes", "unbind", "chunk", "unflatten", "flatten",
    )
)  # fmt: skip


class _InertOnly(torch.utils._python_dispatch.TorchDispatchMode):
    """Notes every aten op outside ``_INERT_OPS`` that runs while a block is captured."""

    def __init__(self) -> None:
        super().__init__()
        self.foreign: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func._schema.name not in _INERT_OPS:
            self.foreign.append(func._schema.name)
        return func(*args, **(kwargs or {}))


class Capture:
    """What ``captured`` yields: after the block, ``graph`` is its ``StepGraph``, or None with
    ``why`` saying what kept the block from being replayable."""

    __slots__ = ("graph", "why")

    def __init__(self) -> None:
        self.graph: StepGraph | None = None
        self.why = "not finished"


@contextlib.contextmanager
def captured(meta: AttentionMetadata, slots: torch.Tensor) -> Iterator[Capture]:
    """``deferred``, keeping the recording as a ``StepGraph`` where it can be replayed for a
    later step: every native call of the block was recorded (no ``flush`` ran part of them
    early), no torch op other than allocations and views ran (``_INERT_OPS``: a torch op's
    work would be missing from the replay), every attention call used ``meta`` and every
    store ``slots`` (int64; the step's own, so a replay can put another step's in their
    place). Outside these conditions ``graph`` stays None and the block has run as under
    ``deferred``. Not nested inside ``deferred``."""
    global _RECORDING
    cap = Capture()
    if _RECORDING is not None or _native is None:
        cap.why = "inside deferred" if _native is not None else "no extension"
        yield cap
        return
    rec = _RECORDING = _Recording()
    guard = _InertOnly()
    try:
        with guard:
            yield cap
    except BaseException:
        _RECORDING = None
        raise
    _RECORDING = None
    if rec.flushed:
        cap.why = "a flush ran recorded calls inside the block"
    elif guard.foreign:
        cap.why = f"torch ran {sorted(set(guard.foreign))} inside the block"
    elif not rec.calls:
        cap.why = "no native call"
    elif any(a[1] is not meta for a in rec.attention):
        cap.why = "an attention call used other metadata"
    elif any(not torch.equal(s, slots) for _, s in rec.stores):
        cap.why = "a store used other slots"
    else:
        cap.graph = StepGraph(rec, slots.numel())
        cap.why = ""
    try:
        _native.run_calls(rec.calls)
    except ValueError as err:
        cap.graph = None
        raise KernelConfigError(str(err)) from None


def _call(op: int, ints: list[int], floats: list[float], keep: object) -> None:
    """One native call: recorded inside ``deferred``, else made now (a ``run_calls`` of one,
    the same checks and kernels)."""
    rec = _rec()
    if rec is not None:
        rec.calls.append((op, ints, floats))
        rec.keep.append(keep)
    else:
        _native.run_calls([(op, ints, floats)])


def available() -> bool:
    """Whether the extension is built (``pip install -e ./kernels`` builds it)."""
    return _native is not None


@dataclass
class Options:
    """Process-wide knobs (tests and benchmarks flip them)."""

    mode: str = os.environ.get("KVCORE_NATIVE_THREADS", "omp")
    portable: bool = os.environ.get("KVCORE_NATIVE_PORTABLE", "") not in ("", "0")
    # auto | avx2 | portable | novnni (the best without the VNNI int8 / VBMI fp8 decode) |
    # noamx (the best without AMX tiles) | noseg (AMX tiles per key tile,
    # not the prefill's key segments of ``cols::head_seg``; for A/B runs) | nodec (bf16 decode
    # on the AVX-512 tile loop, not AMX's ``dec_amx.rs``; for A/B runs) | onepass (bf16 decode
    # off AMX with the tile loop's online softmax, not two passes over the keys; for A/B runs) |
    # tileloop (decode off AMX inside the tile loop, not ``dec_lean.rs``: bf16 in two passes,
    # the same bits; int8 / fp8 in one pass, the same to rounding; for A/B runs)
    isa: str = os.environ.get("KVCORE_NATIVE_ISA", "auto")
    split_keys: int | None = None  # tests: split every item into runs of this many keys
    # one task per item for all its KV heads (True), one per KV head (False), or by the code
    # path and format (None: ``fuse_heads_for``)
    fuse_heads: bool | None = (
        None
        if os.environ.get("KVCORE_NATIVE_FUSE_HEADS", "") == ""
        else os.environ["KVCORE_NATIVE_FUSE_HEADS"] != "0"
    )
    cascade: bool = os.environ.get("KVCORE_NATIVE_CASCADE", "1") not in ("", "0")
    # calls of many rows may take the blocked AVX2 GEMM (read here once: an environment
    # lookup per call cost ~2 us, ~150 calls a step)
    tall: bool = os.environ.get("KVCORE_NATIVE_TALL", "1") != "0"


OPTIONS = Options()


def options_key() -> tuple:
    """``OPTIONS`` as a tuple: what a recorded call's codes depend on besides its arguments (a
    ``StepGraph`` is kept per value)."""
    o = OPTIONS
    return (o.mode, o.portable, o.isa, o.split_keys, o.fuse_heads, o.cascade, o.tall)


# the extension's ISA_BEST / _PORTABLE / _AVX2 / _NO_VNNI / _NO_AMX
ISA_CODES = {
    "auto": 0, "portable": 1, "avx2": 2, "novnni": 3, "noamx": 4, "noseg": 5, "nodec": 6,
    "onepass": 7, "tileloop": 8,
}  # fmt: skip
# the best instance, or it with one A/B switch that leaves the VNNI decode and the linear alone
_BEST_ISAS = tuple(ISA_CODES[k] for k in ("auto", "noamx", "noseg", "nodec", "onepass", "tileloop"))


def _isa() -> int:
    """The extension's code of the code path ``OPTIONS`` asks for."""
    if OPTIONS.portable:
        return ISA_CODES["portable"]
    try:
        return ISA_CODES[OPTIONS.isa]
    except KeyError:
        raise KernelConfigError(
            f"KVCORE_NATIVE_ISA={OPTIONS.isa!r}: expected one of {sorted(ISA_CODES)}"
        ) from None


@functools.cache
def _cpu_has_avx512() -> bool:
    return bool(_native is not None and _native.features()[0])


@functools.cache
def _cpu_has_avx2() -> bool:
    """AVX2 + FMA + F16C: what the AVX2 instance needs (asked once: every call decides by it)."""
    return bool(_native is not None and _native.features()[4])


def fuse_heads_for(fmt: int, query_dtype: torch.dtype | None = None) -> bool:
    """Whether a call over a cache of format ``fmt`` runs one task per item for all its KV heads
    (``OPTIONS.fuse_heads`` where set). By default: off the AVX-512 path over 2- and 4-byte
    elements (there the kernel waits on memory, and a token's heads, adjacent in a block, stream
    as one run: AVX2 Zen 3, one thread, bf16 decode 1.2-1.5x faster, where a task per head
    reads 128 of every 384 bytes); on the AVX2 path over int8 / fp8 too (since its prefetches
    walk a block in address order and fp8 is read raw: Zen 3, one thread, decode 8 x 4K to
    8 x 16K, two rounds x 3 seeds, int8 1.07-1.20x bf16's speed against 0.95-1.08x a task per
    head, fp8 0.94-1.12x against 0.87-1.06x); and over int8 / fp8 where their AVX-512 VNNI /
    VBMI decode runs (bf16 queries, or ``query_dtype`` None): a block's heads are one contiguous
    run there, and the heads' tiles overlap (Zen 4, one thread, decode 8 x 4K to 8 x 16K and
    2 x 4K, two runs: int8 1.03-1.21x, fp8 1.03-1.19x faster warm; cold 1.02-1.16x and
    0.92-1.13x). On AVX-512 over bf16 where the two-pass decode runs (AVX-512 BF16, AMX's decode
    off: ``_two_pass_decode``): a decode tile's bookkeeping (block-table reads, key addresses,
    masks, prefetches) is shared by the heads, ~40 % of a tile there (Zen 4, 2026-12-06: decode
    48 x 320 1.29x faster warm, 1.13-1.26x cold at one thread, 1.07-1.37x at two; 1 x 16K to 8 x 4K
    1.07-1.19x; prefill unchanged, 0.98-1.13x). Not on AVX-512 over bf16 elsewhere (the tile
    loop's one pass: 0.87-1.02x cold), over fp32 / fp16, nor on its widening int8 / fp8 path
    (``novnni`` and fp32 queries: 8-17 % slower, Zen 4)."""
    if OPTIONS.fuse_heads is not None:
        return OPTIONS.fuse_heads
    avx512 = _isa() != ISA_CODES["portable"] and _isa() != ISA_CODES["avx2"] and _cpu_has_avx512()
    if fmt == FMT_BF16 and avx512 and _two_pass_decode():
        return True
    if fmt in (FMT_INT8, FMT_E4M3, FMT_E5M2):
        if not avx512:  # the AVX2 instance, or the portable one
            return _isa() != ISA_CODES["portable"] and _cpu_has_avx2()
        return _isa() in _BEST_ISAS and _cpu_has_vnni() and query_dtype in (None, torch.bfloat16)
    return not avx512 and fmt in (FMT_F32, FMT_BF16, FMT_F16)


def _two_pass_decode() -> bool:
    """Whether bf16 decode items take the two-pass decode (``dec_lean.rs``; with ``tileloop``
    the same two passes inside ``attend.rs``'s tile loop, ``two_pass``): the best instance or
    ``novnni`` (not ``onepass``), AVX-512 BF16, and AMX's decode (``dec_amx.rs``) off: no tiles
    granted, or ``noamx`` / ``nodec``."""
    isa = _isa()
    if isa not in (*_BEST_ISAS, ISA_CODES["novnni"]) or isa == ISA_CODES["onepass"]:
        return False
    bf16_dot, amx = _cpu_bf16_dot_and_amx()
    return bf16_dot and (not amx or isa in (ISA_CODES["noamx"], ISA_CODES["nodec"]))


@functools.cache
def _cpu_bf16_dot_and_amx() -> tuple[bool, bool]:
    """(AVX-512 with BF16 dot products, AMX tiles granted), asked once: every layer's call
    decides its tasks by it."""
    f = _native.features() if _native is not None else None
    return bool(f and f[0] and f[1]), bool(f and f[2])


@functools.cache
def _cpu_has_vnni() -> bool:
    """AVX-512 VNNI + VBMI and BF16: what the int8 / fp8 decode paths need."""
    f = _native.features() if _native is not None else None
    return bool(f and f[1] and f[5])


def features() -> dict[str, bool]:
    """What the extension found: the AVX-512 path, AVX-512 BF16, AVX-512 VNNI + VBMI (the int8
    / fp8 decode), AMX-BF16 tiles granted by the OS (the prefill path's products and the small
    linear above 8 rows; ``KVCORE_NATIVE_NO_AMX=1`` turns them off, ``KVCORE_NATIVE_ISA=noamx``
    for the attention alone), the AVX2 path, torch's ``GOMP_parallel``."""
    if _native is None:
        return {"native": False}
    _bind_openmp()
    avx512, bf16, amx, gomp, avx2, vnni = _native.features()
    return {
        "native": True, "avx512": avx512, "avx512_bf16": bf16, "avx512_vnni": vnni,
        "avx2": avx2, "amx": amx, "omp": gomp,
    }  # fmt: skip


_GOMP_DONE = False


def _bind_openmp() -> None:
    """Hand the extension ``GOMP_parallel`` of the libgomp torch itself loaded (Linux), once."""
    global _GOMP_DONE
    if _GOMP_DONE or _native is None:
        return
    _GOMP_DONE = True
    if "OpenMP" not in torch.__config__.parallel_info():
        return
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            _native.set_gomp_parallel(ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value)
            return
        except (OSError, AttributeError):
            continue


@dataclass(eq=False)
class NativeWork:
    """One step's items and merge groups for one (window, heads, head_dim) configuration."""

    work: np.ndarray  # int64 [num_items, 6]: req, tok0, ntok, key_lo, key_hi, partial offset
    # int64 [num_merges, 5]: tok0, ntok, num_splits, first partial offset, offset step
    merges: np.ndarray
    partial: torch.Tensor  # float32 scratch for split partials (acc, m, l per row)
    max_rows: int
    qsl: np.ndarray  # int64, contiguous: what the kernel reads
    seq_lens: np.ndarray
    table: np.ndarray
    cascade_requests: int = 0  # decode requests whose shared prefix a cascade item reads
    # ``_step_ints`` of this work (its metadata's, which it is cached in): made once, read by
    # every layer's call (numpy's ``ctypes.data`` builds an object per read)
    step_ints: tuple[int, ...] | None = None


def work_for(
    meta: AttentionMetadata,
    window: int | None,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    threads: int,
    alibi: bool = False,
    fuse: bool | None = None,
) -> NativeWork:
    """The items of a step (cached in ``meta.cache``): built once, read by every layer.
    ``fuse``: one task per item for all its KV heads (None: ``OPTIONS.fuse_heads``, else no)."""
    cascade = OPTIONS.cascade and not window and not alibi
    fuse = bool(OPTIONS.fuse_heads) if fuse is None else fuse
    key = ("native", window, num_kv_heads, group, head_dim, threads, OPTIONS.split_keys,
           fuse, cascade)  # fmt: skip
    work = meta.cache.get(key)
    if work is None:
        work = meta.cache[key] = _build(
            meta, window, num_kv_heads, group, head_dim, threads, cascade, fuse
        )
    return work


def _shared_runs(
    meta: AttentionMetadata, q_lens: np.ndarray, per_item: int, min_requests: int
) -> list[tuple[int, int, int]]:
    """Cascade groups: ``(first request, requests, shared keys)``. A run of at least
    ``min_requests`` consecutive decode requests whose block tables start with the same block
    (a cached prefix the radix cache shares) is cut into even groups of at most ``per_item``;
    each group shares the whole blocks its tables have in common before every request's own
    last token, up to the first null (released) entry, if that is ``MIN_CASCADE_KEYS`` or more."""
    table, lens, bs = meta.host_block_table, meta.host_seq_lens, meta.block_size
    decode = (q_lens == 1) & (table[:, 0] != 0) if table.shape[1] else q_lens < 0
    runs, r, n = [], 0, len(q_lens)
    while r < n:
        if not decode[r]:
            r += 1
            continue
        end = r + 1
        while end < n and decode[end] and table[end, 0] == table[r, 0]:
            end += 1
        if end - r >= min_requests:
            groups = -(-(end - r) // per_item)
            cuts = [r + (end - r) * k // groups for k in range(groups + 1)]
            for lo, hi in zip(cuts, cuts[1:], strict=False):
                full = int(((lens[lo:hi] - 1) // bs).min())
                same = (table[lo:hi, :full] == table[lo, :full]).all(axis=0)
                same &= table[lo, :full] != 0
                blocks = int(np.argmin(same)) if not same.all() else full
                if blocks * bs >= MIN_CASCADE_KEYS:
                    runs.append((lo, hi - lo, blocks * bs))
        r = end
    return runs


def _build(
    meta: AttentionMetadata,
    window: int | None,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    threads: int,
    cascade: bool = False,
    fuse: bool = False,
) -> NativeWork:
    qsl, lens = meta.host_query_start_loc, meta.host_seq_lens
    q_lens = np.diff(qsl)
    ctx = lens - q_lens
    reqs = np.flatnonzero(q_lens > 0)
    # Not halved for a short chunk on 2 threads (fewer tasks): 1 x 64 / 128 tokens ran 13-20 %
    # slower in items of 16 / 32 tokens than in one / two of 64 (2026-12-04, Zen 4).
    per_item = min(256, max(1, PREFILL_ITEM_ROWS // group))
    n_chunks = -(-q_lens[reqs] // per_item)
    req = np.repeat(reqs, n_chunks)
    first = np.arange(len(req)) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    start = first * per_item  # first query token of the item within its request
    ntok = np.minimum(per_item, q_lens[req] - start)
    first_pos = ctx[req] + start
    key_hi = first_pos + ntok
    key_lo = np.maximum(first_pos - window + 1, 0) if window else np.zeros_like(key_hi)
    span = key_hi - key_lo
    # Splits: only when the items alone cannot keep the threads busy.
    splits = np.ones_like(span)
    per_item = 1 if fuse else num_kv_heads  # tasks per item
    if len(span) and threads > 1 and len(span) * per_item < TASKS_PER_THREAD * threads:
        target = -(-int(span.sum()) * per_item // (TASKS_PER_THREAD * threads))
        split_len = max(MIN_SPLIT_KEYS, -(-target // 16) * 16)
        splits = np.clip(-(-span // split_len), 1, MAX_SPLITS)
    if OPTIONS.split_keys:
        splits = np.clip(-(-span // OPTIONS.split_keys), 1, MAX_SPLITS)
    rows = ntok * group
    tok_block = num_kv_heads * group * (head_dim + 2)  # floats of one token's partial
    items, merges, offset = [], [], 0
    # Cascade (FlashInfer's idea): decode requests sharing a cached prefix read its K/V once,
    # as the query tokens of one item, and merge that partial with their own keys'. Not with
    # splits (a step with few tasks), windows or ALiBi (the item's rows borrow positions).
    in_cascade = np.zeros(len(q_lens), dtype=bool)
    runs = []
    if cascade and (splits == 1).all():
        per_run = max(1, ITEM_ROWS // group)
        runs = _shared_runs(meta, q_lens, per_run, MIN_CASCADE_REQUESTS)
    for r0, n, shared in runs:
        in_cascade[r0 : r0 + n] = True
        items.append((r0, int(qsl[r0]), n, 0, shared, offset))
        for k in range(n):  # request k's own partial sits n tokens after its prefix partial
            own = offset + (n + k) * tok_block
            items.append((r0 + k, int(qsl[r0 + k]), 1, shared, int(lens[r0 + k]), own))
            merges.append((int(qsl[r0 + k]), 1, 2, offset + k * tok_block, n * tok_block))
        offset += 2 * n * tok_block
    for i in range(len(req)):
        if in_cascade[req[i]]:
            continue
        base = (int(req[i]), int(qsl[req[i]] + start[i]), int(ntok[i]))
        s = int(splits[i])
        if s == 1:
            items.append((*base, int(key_lo[i]), int(key_hi[i]), -1))
            continue
        cut = -(-int(span[i]) // s)
        cut = -(-cut // 16) * 16
        edges = [int(key_lo[i]) + k * cut for k in range(s)] + [int(key_hi[i])]
        edges = [e for e in edges if e < key_hi[i]] + [int(key_hi[i])]
        block = int(rows[i]) * num_kv_heads * (head_dim + 2)  # floats of one split's partial
        merges.append((base[1], base[2], len(edges) - 1, offset, block))
        for lo, hi in zip(edges, edges[1:], strict=False):
            items.append((*base, lo, hi, offset))
            offset += block
    work = np.array(items, dtype=np.int64).reshape(-1, 6)
    cost = work[:, 2] * (work[:, 4] - work[:, 3])
    work = np.ascontiguousarray(work[np.argsort(-cost, kind="stable")])  # longest first
    return NativeWork(
        work=work,
        merges=np.array(merges, dtype=np.int64).reshape(-1, 5),
        partial=torch.empty(max(offset, 1), dtype=torch.float32),
        max_rows=int(work[:, 2].max()) * num_kv_heads * group if len(work) else 1,
        qsl=np.ascontiguousarray(qsl, dtype=np.int64),
        seq_lens=np.ascontiguousarray(lens, dtype=np.int64),
        table=np.ascontiguousarray(meta.host_block_table, dtype=np.int64),
        cascade_requests=int(in_cascade.sum()),
    )


def run(
    query: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    *,
    kv_ptr: int,
    fmt: int,
    strides: tuple[int, int, int, int],  # bytes: block, token, head, K -> V
    scale_offset: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    alibi_slopes: torch.Tensor | None,
    fp8_scale: torch.Tensor | None,
    q_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's call: the caller checked the arguments; ``out`` is written in place.
    ``q_rotation`` (float32 ``[D, D]``, contiguous): the kernel uses ``query @ q_rotation``
    rounded to the query's dtype, as ``QuantKVCache.rotate_in`` would give it."""
    _bind_openmp()
    hq, d = query.shape[1], query.shape[2]
    threads = torch.get_num_threads()
    fuse = fuse_heads_for(fmt, query.dtype)
    work = work_for(
        meta, sliding_window, num_kv_heads, hq // num_kv_heads, d, threads,
        alibi=alibi_slopes is not None, fuse=fuse,
    )  # fmt: skip
    if len(work.work) == 0:
        return out
    ints = [
        query.data_ptr(), query.stride(0), query.stride(1),
        out.data_ptr(), out.stride(0), out.stride(1), DTYPE_CODES[query.dtype],
        kv_ptr, fmt, *strides[:3], strides[3], scale_offset,
        hq, num_kv_heads, d, meta.block_size,
        0, 0, 0, 0, int(sliding_window or 0),  # the step's arrays: _STEP_INTS below
        0 if alibi_slopes is None else alibi_slopes.data_ptr(),
        0 if fp8_scale is None else fp8_scale.data_ptr(),
        0 if q_rotation is None else q_rotation.data_ptr(),
        0, 0, 0, 0, 0, 0, 0,
        threads, MODES[OPTIONS.mode], _isa(), int(fuse),
    ]  # fmt: skip
    for i, v in zip(_STEP_INTS, _step_ints(meta, work), strict=True):
        ints[i] = v
    keep = (query, out, work, alibi_slopes, fp8_scale, q_rotation)
    _call(_CALL_ATTENTION, ints, [float(scale), float(soft_cap or 0.0)], keep)
    rec = _rec()
    if rec is not None:  # where a replay (``StepGraph``) patches in its step's arrays
        rec.attention.append(
            (ints, meta, sliding_window, num_kv_heads, hq // num_kv_heads, d,
             alibi_slopes is not None, fuse)
        )  # fmt: skip
    return out


# The attention record's ints that come from the step (its metadata and work list), in the
# order ``_step_ints`` gives them: ``run`` writes them, ``StepGraph.replay`` rewrites them.
_STEP_INTS = (18, 19, 20, 21, 26, 27, 28, 29, 30, 31, 32)


def _step_ints(meta: AttentionMetadata, work: NativeWork) -> tuple[int, ...]:
    ints = work.step_ints
    if ints is None:  # a work list belongs to one metadata (``work_for`` caches it there)
        ints = work.step_ints = (
            work.qsl.ctypes.data, work.seq_lens.ctypes.data, work.table.ctypes.data,
            work.table.shape[1], int(bool(meta.num_released)),
            work.work.ctypes.data, len(work.work), work.merges.ctypes.data, len(work.merges),
            work.partial.data_ptr(), work.max_rows,
        )  # fmt: skip
    return ints


def store(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Write a step's K/V rows into their slots in place (the caller checked the arguments with
    ``check_store_args``); False, with nothing written, where the layout is not the one the
    native copy takes (a token's heads not contiguous in the source or in a slot: the twin
    runs). A slot past the cache's end raises ``KernelConfigError`` before any write."""
    if _native is None or kv_cache.device.type != "cpu":
        return False
    nb, _, bs, hk, d = kv_cache.shape
    rows_ok = all(t.stride(1) == d and t.stride(2) == 1 for t in (key, value))
    if not rows_ok or kv_cache.stride(3) != d or kv_cache.stride(4) != 1:
        return False
    n = key.shape[0]
    if n == 0:
        return True
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    slots = slots.contiguous()
    e = kv_cache.element_size()
    ints = [
        key.data_ptr(), value.data_ptr(), key.stride(0) * e, value.stride(0) * e, hk * d * e,
        kv_cache.data_ptr(), kv_cache.stride(0) * e, kv_cache.stride(1) * e,
        kv_cache.stride(2) * e, bs, nb * bs, slots.data_ptr(), n,
    ]  # fmt: skip
    try:
        _call(_CALL_STORE, ints, [], (key, value, kv_cache, slots))
    except ValueError as err:
        raise KernelConfigError(str(err)) from None
    rec = _rec()
    if rec is not None:  # ints[_STORE_SLOTS]: what a replay (``StepGraph``) patches
        rec.stores.append((ints, slots))
    return True


_STORE_SLOTS = 11  # the store record's int holding the slots' address
_STORE_INTS, _ATTENTION_INTS = 13, 37  # ints per record (``run_calls`` checks the same counts)


def elementwise(
    op: int, rows: int, dim: int, x: int, x_stride: int, y: int, y_stride: int, w: int,
    out: int, out_stride: int, eps: float = 0.0, heads: int = 0, head_stride: int = 0,
    keep: tuple = (),
) -> None:  # fmt: skip
    """One row-wise bf16 op of ``ops_cpu`` over addresses and element strides (the caller
    checked the tensors) on the kernel's threads; ``keep``: the tensors behind the addresses
    (held until a ``deferred`` call has run)."""
    _bind_openmp()
    ints = [
        op, rows, dim, x, x_stride, y, y_stride, w, out, out_stride, heads, head_stride,
        torch.get_num_threads(), MODES[OPTIONS.mode], _isa(),
    ]  # fmt: skip
    _call(_CALL_ELEMENTWISE, ints, [float(eps)], keep)


def argmax_bf16(x: int, rows: int, n: int, stride: int, out: int) -> None:
    """Row-wise argmax of bf16 rows over addresses (``ops_cpu.argmax_rows`` checked the tensor)
    into ``out`` (int64), on the calling thread."""
    flush()  # x may be a recorded call's output
    _native.argmax_bf16(x, rows, n, stride, out)


def linear_fast_path() -> bool:
    """Whether the small-batch linear has its AVX-512 BF16 path here (False without the
    extension)."""
    return _native is not None and bool(_native.linear_fast_path())


def linear_avx2_path() -> bool:
    """Whether the small-batch linear has its AVX2 path for plain (not gated) weights here (an
    AVX2 CPU without AVX-512 BF16; False without the extension)."""
    return _native is not None and bool(_native.linear_avx2_path())


def linear_tall_allowed() -> bool:
    """Whether calls of many rows may take the blocked AVX2 GEMM (``OPTIONS.tall``; at start,
    ``KVCORE_NATIVE_TALL=0`` keeps the small-row panels for every row count, for A/B runs)."""
    return OPTIONS.tall


def linear(
    x: int, x_stride: int, rows: int, k: int, w: int, n_out: int, bias: int, out: int,
    out_stride: int, glu: bool = False, keep: tuple = (),
) -> None:  # fmt: skip
    """A bf16 linear over addresses (``linear_cpu`` checked the tensors) on the kernel's
    threads; ``glu``: a gated weight, ``silu(gate) * up`` out. On the AVX2 path, calls of
    ``TALL_ROWS`` (12) rows or more take the blocked GEMM unless ``linear_tall_allowed()`` says
    no. ``keep``: the tensors behind the addresses (held until a ``deferred`` call has run)."""
    _bind_openmp()
    ints = [
        x, x_stride, rows, k, w, n_out, bias, out, out_stride, torch.get_num_threads(),
        MODES[OPTIONS.mode], int(_isa() not in _BEST_ISAS), int(glu), int(linear_tall_allowed()),
    ]  # fmt: skip
    _call(_CALL_LINEAR, ints, [], keep)
