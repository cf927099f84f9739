"""The paged KV cache: its one layout, allocation and the checks every kernel shares.

Layout (per layer, one tensor, the model's dtype)::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]
               index 1: 0 = K, 1 = V
    slot = block_id * block_size + offset      (offset in [0, block_size))

Block 0 is the null block: block tables pad with it, the store never writes it and attention
never reads it for a real token. Kernels take strides, so any view with a unit-stride last
dimension works; ``allocate_kv_cache`` returns the contiguous layout above (zeroed, so even
the null block holds finite values).
"""

from __future__ import annotations

import torch

from kvcore_kernels.device import normalize_device
from kvcore_kernels.errors import KernelConfigError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NULL_BLOCK = 0


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
    return torch.zeros(shape, dtype=dtype, device=normalize_device(device))


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
