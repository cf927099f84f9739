"""The paged KV cache: its one layout, allocation and the checks every kernel shares.

Layout (per layer, one tensor, the model's dtype)::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
               index 1: 0 = K, 1 = V
    slot = block_id * block_size + offset      (offset in [0, block_size))

Block 0 is the null block: block tables pad with it, the store never writes it and attention
never reads it for a real token. Kernels take strides, so any view with a unit-stride last
dimension works; ``allocate_kv_cache`` returns the contiguous layout above (zeroed, so even
the null block holds finite values).

On the CPU a cache of 2 MiB or more lives in 2 MiB pages where Linux lends them (``zeros``):
a step reads blocks scattered over the whole cache, and with 4 KiB pages nearly every block
read walks the page table.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from kvcore_kernels.device import normalize_device
from kvcore_kernels.errors import KernelConfigError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NULL_BLOCK = 0

#: The size of a transparent huge page on x86-64 and of the alignment ``zeros`` gives a cache.
HUGE_PAGE_BYTES = 2 << 20


def huge_pages_enabled() -> bool:
    """Whether ``zeros`` asks for huge pages: Linux's ``madvise(MADV_HUGEPAGE)`` exists and
    ``KVCORE_HUGE_PAGES`` is not ``0``."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("KVCORE_HUGE_PAGES", "1") != "0"


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU, from 2 MiB up, in an anonymous mapping advised
    ``MADV_HUGEPAGE`` (transparent huge pages, honoured when the system's THP mode is
    ``madvise`` or ``always``) and aligned to 2 MiB, touched here as ``torch.zeros`` would.

    Why: the attention kernel reads a request's blocks wherever the allocator put them. With
    4 KiB pages a 12 KiB block spans up to four pages and the TLB covers 8 MiB of them at best
    (Zen 3's 2,048 L2 entries), so a long decode walks the page table at nearly every block.
    The tensor owns the mapping (``torch.frombuffer`` keeps it referenced): it is unmapped when
    the last view goes."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or not huge_pages_enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    # Anonymous and private (as malloc's memory: a fork copies it on write), zero-filled.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=flags)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP: 4 KiB pages, the same tensor
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    out = raw[start : start + nbytes].view(dtype).view(shape)
    out.zero_()  # fault every page in now (the RSS at start, no page faults inside a step)
    return out


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (block 0 = null)."""
    for name, value, low in (
        ("num_blocks", num_blocks, 2),
        ("block_size", block_size, 1),
        ("num_kv_heads", num_kv_heads, 1),
        ("head_dim", head_dim, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise KernelConfigError(f"{name} must be an int >= {low}, got {value!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise KernelConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    return zeros(shape, dtype, normalize_device(device))


def check_kv_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check the layout; return ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
    if not isinstance(kv_cache, torch.Tensor):
        raise KernelConfigError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise KernelConfigError(
            "kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise KernelConfigError(
            f"kv_cache dtype must be one of {SUPPORTED_DTYPES}, got {kv_cache.dtype}"
        )
    if kv_cache.stride(-1) != 1:
        raise KernelConfigError("kv_cache must have a unit-stride last (head_dim) dimension")
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_backend(backend: str, device: torch.device) -> str:
    """Resolve ``backend`` ("auto", "triton", "torch" or "cpu") for tensors on ``device``.

    "auto" resolves to "triton" on CUDA, else "torch"; the attention dispatchers then prefer the
    native CPU kernel over the twin on the CPU. "cpu" (the native kernel) names a CPU-only
    backend; ops without a native kernel (the stores) run their twin for it."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in ("triton", "torch", "cpu"):
        raise KernelConfigError(
            f"backend must be 'auto', 'triton', 'torch' or 'cpu', got {backend!r}"
        )
    if backend == "cpu" and device.type != "cpu":
        raise KernelConfigError(f"backend='cpu' runs on the CPU, tensors are on {device}")
    if backend == "triton" and not triton_available():
        raise KernelConfigError("backend='triton' but triton is not installed")
    return backend


def triton_available() -> bool:
    """Whether ``import triton`` works (cached)."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except ImportError:
            _TRITON = False
    return _TRITON


_TRITON: bool | None = None
