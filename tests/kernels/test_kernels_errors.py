"""Bad input raises KernelConfigError (a ValueError) at call time and writes nothing."""

from __future__ import annotations

import kvcore_kernels as kk
import numpy as np
import pytest
import torch
from kernel_reference import triton_interpreted

QSL = [0, 3, 4]
LENS = [5, 9]
TABLE = [[1, 0], [2, 3]]


def plan(**over):
    args = dict(query_start_loc=QSL, seq_lens=LENS, block_table=TABLE, block_size=8)
    args.update(over)
    return kk.plan_attention(**args)


def test_error_is_a_value_error():
    assert issubclass(kk.KernelConfigError, ValueError)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 8.0}, "block_size"),
        ({"query_start_loc": [0, 3]}, "num_reqs \\+ 1"),
        ({"query_start_loc": [1, 3, 4]}, "must be 0"),
        ({"query_start_loc": [0, 4, 3]}, "non-decreasing"),
        ({"query_start_loc": [0.0, 3.0, 4.0]}, "integers"),
        ({"query_start_loc": torch.tensor([0.0, 3.0, 4.0])}, "int32 or int64"),
        ({"seq_lens": [2, 9]}, "3 query tokens but seq_len 2"),
        ({"block_table": [[1], [2]]}, "needs 2 blocks"),
        ({"block_table": [[1, 0]]}, "rows"),
        ({"block_table": [1, 2]}, "dimension"),
        ({"block_table": [[0, 0], [2, 3]]}, "null block"),
        ({"block_table": [[1, 0], [2, -4]]}, "null block"),
    ],
)
def test_plan_rejects(over, match):
    with pytest.raises(kk.KernelConfigError, match=match):
        plan(**over)


def test_plan_accepts_numpy_and_tensors():
    a = plan(query_start_loc=np.array(QSL, dtype=np.int32), seq_lens=torch.tensor(LENS))
    assert (a.num_reqs, a.num_tokens, a.max_q_len, a.max_seq_len, a.max_block_id) == (2, 4, 3, 9, 3)
    assert a.query_start_loc.dtype == torch.int32 and a.block_table.shape == (2, 2)


def call(backend="torch", **over):
    """One paged_attention call with ``over`` replacing a good argument."""
    cache = kk.allocate_kv_cache(4, 8, 2, 64, torch.float32, "cpu")
    args = dict(query=torch.randn(4, 4, 64), kv_cache=cache, meta=plan(), scale=0.125)
    args["out"] = torch.full((4, 4, 64), 7.0)
    args.update(over)
    query, kv_cache, meta = args.pop("query"), args.pop("kv_cache"), args.pop("meta")
    kk.paged_attention(query, kv_cache, meta, backend=backend, **args)


BAD_CALLS = [
    ({"query": torch.randn(5, 4, 64)}, "query must be"),
    ({"query": torch.randn(4, 3, 64)}, "multiple of num_kv_heads"),
    ({"query": torch.randn(4, 4, 32)}, "query must be"),
    ({"query": torch.randn(4, 4, 64, dtype=torch.float16)}, "float16"),
    ({"query": torch.randn(4, 64, 4).transpose(1, 2)}, "unit-stride"),
    ({"kv_cache": torch.zeros(4, 8, 2, 64)}, "kv_cache must be"),
    ({"kv_cache": torch.zeros(4, 2, 16, 2, 64)}, "block_size 16"),
    ({"kv_cache": torch.zeros(3, 2, 8, 2, 64)}, "uses block 3"),
    ({"kv_cache": torch.zeros(4, 2, 8, 2, 64, dtype=torch.float64)}, "dtype"),
    ({"meta": "nope"}, "plan_attention"),
    ({"scale": 0.0}, "scale"),
    ({"scale": float("nan")}, "scale"),
    ({"scale": True}, "scale"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": 2.5}, "sliding_window"),
    ({"soft_cap": -1.0}, "soft_cap"),
    ({"alibi_slopes": torch.ones(2)}, "alibi_slopes"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, "alibi_slopes"),
    ({"out": torch.zeros(4, 4, 64, dtype=torch.float16)}, "out must be"),
    ({"out": torch.zeros(4, 4, 63)}, "out must be"),
    ({"backend": "cuda"}, "backend"),
]


@pytest.mark.parametrize("over, match", BAD_CALLS)
def test_attention_rejects(over, match):
    out = over.setdefault("out", torch.full((4, 4, 64), 7.0))
    before = out.clone()
    with pytest.raises(kk.KernelConfigError, match=match):
        call(**over)
    assert torch.equal(out, before)


def test_triton_rejects_what_it_does_not_support():
    if not triton_interpreted():
        pytest.skip("Triton kernels are not running under TRITON_INTERPRET=1 here")
    cache = kk.allocate_kv_cache(4, 8, 1, 96, torch.float32, "cpu")
    with pytest.raises(kk.KernelConfigError, match="head_dim"):
        call("triton", query=torch.randn(4, 4, 96), kv_cache=cache, out=None)
    cache = kk.allocate_kv_cache(4, 8, 1, 64, torch.float32, "cpu")
    with pytest.raises(kk.KernelConfigError, match="query heads per KV head"):
        call("triton", query=torch.randn(4, 32, 64), kv_cache=cache, out=None)


def test_twin_supports_other_head_dims():
    """The twin has no power-of-two constraint (e.g. head_dim 96 runs on the CPU)."""
    cache = kk.allocate_kv_cache(4, 8, 2, 96, torch.float32, "cpu")
    cache[1:].normal_()
    out = kk.paged_attention(torch.randn(4, 4, 96), cache, plan(), scale=0.1, backend="torch")
    assert torch.isfinite(out).all()


def test_allocate_kv_cache():
    cache = kk.allocate_kv_cache(10, 16, 3, 64, torch.bfloat16, "cpu")
    assert cache.shape == (10, 2, 16, 3, 64) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and cache.count_nonzero() == 0
    with pytest.raises(kk.KernelConfigError, match="num_blocks"):
        kk.allocate_kv_cache(1, 16, 3, 64, torch.float32, "cpu")
    with pytest.raises(kk.KernelConfigError, match="dtype"):
        kk.allocate_kv_cache(4, 16, 3, 64, torch.int8, "cpu")


def test_twins_share_signatures():
    """Each Triton launcher and its torch twin take the same arguments."""
    import inspect

    pytest.importorskip("triton")
    for name in ("paged_attention", "store_kv"):
        torch_sig = inspect.signature(getattr(kk, name + "_torch"))
        triton_sig = inspect.signature(getattr(kk, name + "_triton"))
        assert torch_sig == triton_sig, name
    assert "backend" in inspect.signature(kk.paged_attention).parameters
