"""Split-KV (flash-decoding, Dao et al.): how many splits, and the kernel that merges them.

A paged attention grid with few programs (a decode batch of one, few KV heads) splits every
program's key range into ``num_splits`` contiguous shares; each writes an unnormalised partial
``(acc, max, sum)`` and ``merge_splits_kernel`` (grid: tokens x query heads) combines them.
``num_kv_splits`` is a pure function of the grid, the keys and the SM count, so it is tested on
the CPU (``tests/kernels/test_kernels_splits.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in merging than it gains
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4  # split until the grid has this many programs per SM (num_kv_splits)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so that tests reach the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits(
    num_programs: int, max_keys: int, num_sms: int, block_n: int = 64, min_keys: int | None = None
) -> int:
    """Splits of every program's key range (flash-decoding) for a grid of ``num_programs`` =
    query tiles x KV heads over ``max_keys`` keys on ``num_sms`` SMs: enough that the grid
    reaches ``PROGRAMS_PER_SM`` programs per SM (a batch of one with 8 KV heads has 8 programs:
    without splits 124 of an H200's 132 SMs idle, and a few resident programs per SM cannot keep
    enough loads in flight to cover HBM latency), each split at least ``min_keys`` long (default
    ``MIN_KEYS_PER_SPLIT``: shorter ones cost more to merge than they save), at most
    ``MAX_SPLITS``, and none empty (every split gets whole ``block_n`` tiles). Pure function."""
    min_keys = MIN_KEYS_PER_SPLIT if min_keys is None else min_keys
    target = num_sms * PROGRAMS_PER_SM
    if num_programs <= 0 or num_programs >= target:
        return 1
    splits = min(-(-target // num_programs), max_keys // max(1, min_keys), MAX_SPLITS)
    if splits <= 1:
        return 1
    tiles = -(-max_keys // block_n)
    per_split = max(1, tiles // splits, -(-tiles // MAX_SPLITS))  # whole tiles, rounded down
    return max(1, -(-tiles // per_split))  # the kernel's cdiv(tiles, splits) leaves none empty


def choose_num_splits(
    num_programs: int, max_keys: int, device: torch.device, block_n: int = 64
) -> int:
    """``num_kv_splits`` on ``device``'s SM count (4 under the interpreter)."""
    return num_kv_splits(num_programs, max_keys, _num_sms(device), block_n)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    part_acc_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_DIM] fp32
    part_max_ptr,  # [num_splits, num_tokens, num_q_heads] fp32, log2 units
    part_sum_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    num_tokens,
    num_q_heads,
    num_splits,
    stride_out_tok,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    split_ok = splits < num_splits
    part = (splits * num_tokens + tok) * num_q_heads + head  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    m_all = tl.max(m, 0)  # finite: the split holding the query's own position saw a key
    w = tl.exp2(m - m_all)  # [SPLITS_PAD], 0 for splits that saw no key
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(  # [SPLITS_PAD, HEAD_DIM]
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0
    )
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)  # the sum is >= 1
    tl.store(
        out_ptr + tok * stride_out_tok + head * stride_out_head + dims,
        o.to(out_ptr.dtype.element_ty),
    )
