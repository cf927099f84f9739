"""Small helpers shared by the Triton launchers (imported only where Triton is)."""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from kvcore_kernels.errors import KernelConfigError

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was built under ``TRITON_INTERPRET=1`` (runs on the CPU, in NumPy)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_triton_device(tensor: torch.Tensor, kernel: object) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if tensor.device.type == "cuda" and not is_interpreted(kernel):
        return
    if tensor.device.type == "cpu" and is_interpreted(kernel):
        return
    raise KernelConfigError(
        f"the Triton backend cannot run on {tensor.device} here: it needs CUDA tensors, or CPU "
        "tensors with TRITON_INTERPRET=1 set before kvcore_kernels' Triton modules are imported"
    )


def check_dense_metadata(meta: Any) -> None:
    """The kernels read ``query_start_loc`` and ``seq_lens`` as dense arrays (pointer + index)
    and the block table through its row stride only: a strided view (metadata built by hand,
    not by ``plan_attention``, e.g. over a CUDA graph's static buffers) would read other
    requests' values. Raises ``KernelConfigError`` for one."""
    qsl, lens, table = meta.query_start_loc, meta.seq_lens, meta.block_table
    if qsl.stride(0) != 1 or lens.stride(0) != 1:
        raise KernelConfigError("query_start_loc and seq_lens must be contiguous")
    if table.dim() != 2 or table.stride(1) != 1:
        raise KernelConfigError("block_table rows must be contiguous")


def compute_dtype(dtype: torch.dtype, kernel: object) -> tl.dtype:
    """The dtype tiles are fed to ``tl.dot`` in: the storage dtype, except bf16 under the
    interpreter (NumPy has no bf16 arithmetic, so it computes in fp32 there)."""
    if dtype == torch.bfloat16 and is_interpreted(kernel):
        return tl.float32
    return _TL_DTYPES[dtype]
