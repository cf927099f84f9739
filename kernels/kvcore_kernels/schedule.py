"""The tile schedule every Triton attention kernel shares (plain, quantized, latent).

Constants of the launch (head sizes compiled for, query heads per KV head, the "no window"
sentinel, log2(e) for the base-2 online softmax) and ``work_tiles``, the per-step work list
(cached in the metadata). Host-side only: importing it needs neither triton nor a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcore_kernels.plan import AttentionMetadata

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # sliding_window=None: every key is within the window
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
MAX_QUERIES_PER_KV = 16


def work_tiles(meta: AttentionMetadata, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Work list: (request, first query) of every tile, longest key range first (on device)."""
    key = ("triton_tiles", block_q)
    if key not in meta.cache:
        q_lens = meta.host_q_lens
        per_req = (q_lens + block_q - 1) // block_q
        req = np.repeat(np.arange(meta.num_reqs), per_req)
        first = (np.arange(len(req)) - np.repeat(np.cumsum(per_req) - per_req, per_req)) * block_q
        k_end = meta.host_seq_lens[req] - q_lens[req] + np.minimum(first + block_q, q_lens[req])
        order = np.argsort(-k_end, kind="stable")
        meta.cache[key] = tuple(
            torch.from_numpy(a[order].astype(np.int32)).to(meta.device) for a in (req, first)
        )
    return meta.cache[key]
