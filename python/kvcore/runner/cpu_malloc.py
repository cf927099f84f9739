"""glibc malloc settings for the CPU forward: activations reuse the heap instead of fresh pages.

A prefill step of 2,048 tokens allocates activations of 2-13 MB per layer (SmolLM2's gate-up
output is 2,048 x 3,072 bf16: 12.6 MB). glibc serves such blocks with ``mmap`` (above its
dynamic threshold) or gives freed heap memory back to the OS (``trim``), so the next step's
tensors land on fresh pages and every 4 KiB page costs a fault and a zeroing the first time the
GEMM writes it: ~1M extra page faults in the 48-request offline job, ~10 % of its wall, the
prefill GEMMs at 590-670 instead of 750-785 GFLOP/s (docs/engine.md, "Activations on fresh
pages"). Two process-wide ``mallopt`` settings keep them on reused heap memory:

* ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's maximum): blocks below it come from the heap;
* ``M_TRIM_THRESHOLD`` = 512 MiB: free memory at the top of the heap is kept up to that much.

vLLM's CPU build gets the same effect by preloading tcmalloc. Setting either value also turns
off glibc's own adjustment of both. Applied once per process, from ``ModelRunner`` on the CPU;
a no-op off glibc (musl, macOS) or under another allocator (``LD_PRELOAD`` tcmalloc / jemalloc:
they have no ``mallopt`` of their own and glibc's is then not the one serving ``malloc``).
``KVCORE_MALLOC_TUNE=0`` leaves malloc alone. Costs: up to 512 MiB of freed memory stays mapped
in the process (the peak of a step's transient activations, in practice tens of MiB).
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc caps it at HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit
TRIM_THRESHOLD = 512 << 20

_applied: str | None = None


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc serving ``malloc``, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return None
    return libc


def tune_cpu_malloc() -> str | None:
    """Apply the settings above once per process; returns what was set (for the log), or None
    when nothing was (turned off, not glibc, or ``mallopt`` refused)."""
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get("KVCORE_MALLOC_TUNE", "1") in ("0", ""):
        return None
    libc = _glibc()
    if libc is None:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return None
    if not libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return None
    _applied = (
        f"glibc malloc: blocks under {MMAP_THRESHOLD >> 20} MiB from the heap, "
        f"kept up to {TRIM_THRESHOLD >> 20} MiB free"
    )
    return _applied
