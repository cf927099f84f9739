"""Per-step attention metadata: built once by ``plan_attention``, read by every layer.

FlashInfer's plan/run split: everything that depends only on the step's batch (which tokens
belong to which request, how long each sequence is, where its blocks are) is checked and laid
out here, once per step; ``paged_attention`` then runs once per layer with no host work beyond
a few integer comparisons. Backend-specific layouts (the Triton work list, the torch twin's
gather indices and masks) are derived from this on first use and cached in the metadata, so a
model whose layers share a configuration pays for them once per step.

Token ranges of one request ``r`` (``q_len = qsl[r+1] - qsl[r]``, ``ctx = seq_len - q_len``)::

    positions  0 ............ ctx-1 | ctx ........ seq_len-1
               already in the cache | this step's queries (also just stored in the cache)
    query i (0 <= i < q_len) sits at position ctx + i and attends to keys [0, ctx + i]
    (or to the last ``sliding_window`` of them).

Released blocks (retention, docs/retention.md): a block table entry of 0 (``NULL_BLOCK``) inside
a sequence's range is a logical block its retention policy dropped. Positions stay logical; the
kernels give its keys exactly zero weight and never read the null block. The blocks this step
writes (those holding positions ``ctx .. seq_len-1``) must be real: a query always sees itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvcore_kernels.device import normalize_device
from kvcore_kernels.errors import KernelConfigError


@dataclass(eq=False)
class AttentionMetadata:
    """What ``paged_attention`` needs about one step's batch; shared by every layer."""

    num_reqs: int
    num_tokens: int
    block_size: int
    max_q_len: int
    max_seq_len: int
    max_block_id: int  # largest block id a request uses (0 if none): checked against the cache
    device: torch.device
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1] on device
    seq_lens: torch.Tensor  # int32 [num_reqs] on device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks] on device
    host_query_start_loc: np.ndarray  # int64 [num_reqs + 1]
    host_seq_lens: np.ndarray  # int64 [num_reqs]
    host_block_table: np.ndarray  # int64 [num_reqs, max_blocks]
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)  # backend layouts, lazily
    num_released: int = 0  # null entries inside the sequences' ranges (released blocks)

    @property
    def host_q_lens(self) -> np.ndarray:
        """int64 [num_reqs]: new tokens of each request in this step."""
        return np.diff(self.host_query_start_loc)


def _host_int_array(x: Any, name: str, ndim: int) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64):
            raise KernelConfigError(f"{name} must be int32 or int64, got {x.dtype}")
        arr = x.detach().cpu().numpy()
    else:
        arr = np.asarray(x)
        if arr.dtype.kind not in "iu":
            raise KernelConfigError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise KernelConfigError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def plan_attention(
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    block_size: int,
    *,
    device: torch.device | str | None = None,
) -> AttentionMetadata:
    """Check one step's batch and lay out what every layer's ``paged_attention`` reads.

    ``query_start_loc``: [num_reqs + 1] cumulative query lengths (0 first); ``seq_lens``:
    [num_reqs] tokens of each request including this step's; ``block_table``: [num_reqs,
    max_blocks] block ids (padding: 0, the null block; 0 inside a sequence's range: a
    released block, see the module doc). Tensors or NumPy arrays; host arrays are
    cheapest (device tensors cost one copy to the host). ``device``: where the kernels run
    (default: the device of ``query_start_loc`` if it is a tensor, else the CPU), normalised
    (``"cuda"`` -> the current ``cuda:N``, as ``kvcore_kernels.device.normalize_device``).
    Raises ``KernelConfigError`` on inconsistent input.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KernelConfigError(f"block_size must be a positive int, got {block_size!r}")
    qsl = _host_int_array(query_start_loc, "query_start_loc", 1)
    lens = _host_int_array(seq_lens, "seq_lens", 1)
    table = _host_int_array(block_table, "block_table", 2)
    num_reqs = lens.shape[0]
    if qsl.shape[0] != num_reqs + 1:
        raise KernelConfigError(
            f"query_start_loc has {qsl.shape[0]} entries, expected num_reqs + 1 = {num_reqs + 1}"
        )
    if table.shape[0] != num_reqs:
        raise KernelConfigError(f"block_table has {table.shape[0]} rows, expected {num_reqs}")
    if qsl[0] != 0:
        raise KernelConfigError("query_start_loc[0] must be 0")
    q_lens = np.diff(qsl)
    if (q_lens < 0).any():
        raise KernelConfigError("query_start_loc must be non-decreasing")
    if (q_lens > lens).any():
        r = int(np.argmax(q_lens > lens))
        raise KernelConfigError(
            f"request {r}: {int(q_lens[r])} query tokens but seq_len {int(lens[r])}"
        )
    num_blocks_used = (lens + block_size - 1) // block_size
    max_blocks = table.shape[1]
    if num_reqs and int(num_blocks_used.max()) > max_blocks:
        r = int(np.argmax(num_blocks_used))
        raise KernelConfigError(
            f"request {r}: seq_len {int(lens[r])} needs {int(num_blocks_used[r])} blocks of "
            f"{block_size}, block_table has {max_blocks} columns"
        )
    used = np.arange(max_blocks)[None, :] < num_blocks_used[:, None]
    used_ids = table[used]
    if used_ids.size and int(used_ids.min()) < 0:
        raise KernelConfigError("block_table: a used entry is negative (block 0 is the null block)")
    num_released = int((used_ids == 0).sum()) if used_ids.size else 0
    if num_released:  # the blocks this step writes must be real (a query sees its own key)
        written = np.arange(max_blocks)[None, :] >= ((lens - q_lens) // block_size)[:, None]
        bad = used & written & (table == 0) & (q_lens > 0)[:, None]
        if bad.any():
            r, b = (int(x) for x in np.argwhere(bad)[0])
            raise KernelConfigError(
                f"request {r}: block table entry {b} is the null block (released) but this step "
                "writes tokens there"
            )
    max_block_id = int(used_ids.max()) if used_ids.size else 0
    if max_block_id > np.iinfo(np.int32).max or int(qsl[-1]) > np.iinfo(np.int32).max:
        raise KernelConfigError("block ids and token counts must fit in int32")

    if device is None:
        device = query_start_loc.device if isinstance(query_start_loc, torch.Tensor) else "cpu"
    device = normalize_device(device)  # "cuda" -> "cuda:N": compared with tensors' devices

    def to_device(arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(arr.astype(np.int32)).to(device, non_blocking=True)

    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=int(qsl[-1]),
        block_size=block_size,
        max_q_len=int(q_lens.max()) if num_reqs else 0,
        max_seq_len=int(lens.max()) if num_reqs else 0,
        max_block_id=max_block_id,
        device=device,
        query_start_loc=to_device(qsl),
        seq_lens=to_device(lens),
        block_table=to_device(table),
        host_query_start_loc=qsl,
        host_seq_lens=lens,
        host_block_table=table,
        num_released=num_released,
    )
