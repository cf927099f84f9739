"""paged_attention against a float64 dense oracle: torch twin always, Triton on the interpreter
(a subset always, the full product marked slow) and on CUDA when present.

Every run draws fresh inputs (seed in the report); the cache's free slots and the null block hold
NaN and the output buffer starts as NaN, so a kernel that reads a slot it must not, or leaves a
row unwritten, fails.
"""

from __future__ import annotations

import itertools

import kvcore_kernels as kk
import pytest
import torch
from kernel_reference import make_batch, reference_attention, triton_interpreted
from kvcore_kernels import chunks_torch

CASES = {
    # (tokens already cached, query tokens) per request
    "mixed": [(0, 20), (17, 1), (33, 1), (5, 9), (40, 3), (0, 1)],
    "decode": [(30, 1), (7, 1), (64, 1), (1, 1), (15, 1)],
    "prefill": [(0, 37), (0, 5), (0, 16)],
    "prefix_mid_block": [(13, 22), (41, 17), (3, 1)],
}
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 9},
    "softcap": {"soft_cap": 3.0},
    "alibi": {"alibi": True},
    "all": {"sliding_window": 12, "soft_cap": 5.0, "alibi": True},
}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = list(TOL)


def check(
    gen: torch.Generator,
    backend: str,
    reqs: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    features: dict | None = None,
) -> None:
    """One call of ``backend`` on a fresh batch, compared with the float64 oracle."""
    feats = dict(features or {})
    if feats.pop("alibi", False):
        feats["alibi_slopes"] = torch.rand(num_q_heads, generator=gen).to(device) * 0.5
    b = make_batch(
        gen,
        reqs,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
    )
    meta = kk.plan_attention(
        b.query_start_loc, b.seq_lens, b.block_table, block_size, device=device
    )
    scale = head_dim**-0.5
    out = torch.full_like(b.query, float("nan"))
    got = kk.paged_attention(
        b.query, b.kv_cache, meta, scale=scale, out=out, backend=backend, **feats
    )
    assert got is out
    want = reference_attention(b, scale=scale, **feats)
    err = (out.cpu().double() - want).abs().max().item()
    assert err <= TOL[dtype], f"max error {err} (seed {gen.initial_seed()})"


def needs_interpreter():
    if not triton_interpreted():
        pytest.skip("Triton kernels are not running under TRITON_INTERPRET=1 here")


# ---- torch twin: every case, feature and dtype ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("case", CASES)
def test_twin_cases(gen, case, feature, dtype):
    check(gen, "torch", CASES[case], dtype=dtype, features=FEATURES[feature])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3), (16, 1)], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_twin_shapes(gen, head_dim, heads, block_size):
    check(
        gen,
        "torch",
        CASES["mixed"],
        block_size=block_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        features={"sliding_window": 20},
    )


def random_reqs(gen: torch.Generator, n: int, max_ctx: int, max_q: int) -> list[tuple[int, int]]:
    ctx = torch.randint(0, max_ctx + 1, (n,), generator=gen).tolist()
    decode = torch.rand(n, generator=gen) < 0.5
    q = torch.randint(1, max_q + 1, (n,), generator=gen).tolist()
    return [(c, 1 if d else qq) for c, d, qq in zip(ctx, decode.tolist(), q, strict=True)]


def test_twin_random_batches(gen):
    for _ in range(12):
        feats = {}
        if torch.rand(1, generator=gen) < 0.4:
            feats["sliding_window"] = int(torch.randint(1, 40, (1,), generator=gen))
        if torch.rand(1, generator=gen) < 0.3:
            feats["soft_cap"] = 4.0
        block_size = [8, 16, 32, 128][int(torch.randint(0, 4, (1,), generator=gen))]
        check(gen, "torch", random_reqs(gen, 9, 150, 40), block_size=block_size, features=feats)


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 12, 1 << 30])
def test_twin_chunking_does_not_change_results(gen, monkeypatch, chunk_bytes):
    monkeypatch.setattr(chunks_torch, "CHUNK_BYTES_PER_THREAD", chunk_bytes)
    check(gen, "torch", CASES["mixed"] + CASES["decode"], features={"sliding_window": 30})
    check(gen, "torch", CASES["mixed"], features={"soft_cap": 2.0})


def test_twin_chunks_bound_padding(gen):
    """Decodes of 90 and 600 tokens are not padded to one length (the serving profile in
    docs/serving.md): every chunk's padded work stays within MAX_PAD_RATIO of its real work,
    similar lengths still share a chunk, and the results stay exact."""
    reqs = [(600, 1), (90, 1), (95, 1), (530, 1), (250, 1), (92, 1), (0, 40), (300, 8)]
    check(gen, "torch", reqs, features={})
    b = make_batch(
        gen, reqs, block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 16)
    chunks = chunks_torch.build_chunks(meta, None, 1 << 20)
    starts = b.query_start_loc.tolist()
    members = []
    for c in chunks:  # the requests of each chunk, from the tokens its output rows go to
        tokens = set(c.out_index.tolist())
        members.append([r for r in range(len(reqs)) if starts[r] in tokens])
        real = sum(reqs[r][1] * -(-(sum(reqs[r])) // 16) for r in members[-1])
        assert c.num_reqs == len(members[-1])
        assert c.num_reqs * c.q_max * c.num_blocks <= chunks_torch.MAX_PAD_RATIO * real
    assert sorted(r for m in members for r in m) == list(range(len(reqs)))
    assert [1, 2, 5] in members  # the three ~90-token decodes share one chunk
    assert not any(0 in m and 1 in m for m in members)  # 600 and 90 tokens do not


def test_twin_explicit_path_slices_queries(gen, monkeypatch):
    monkeypatch.setattr(chunks_torch, "MAX_SCORE_ELEMENTS", 1000)
    check(gen, "torch", CASES["prefix_mid_block"], features=FEATURES["all"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_twin_fresh_prefill_alone(gen, dtype):
    """One prompt with nothing cached: SDPA's own causal mask, no mask tensor, no gather of q."""
    check(gen, "torch", [(0, 45)], dtype=dtype, block_size=8)
    check(gen, "torch", [(0, 45), (0, 3)], dtype=dtype, block_size=8)


@pytest.mark.parametrize("backend, chunk_bytes", [("torch", 1), ("torch", 1 << 30), ("triton", 1)])
def test_strided_query_and_out(gen, monkeypatch, backend, chunk_bytes):
    """Views with a row stride (slices of a fused QKV projection, of a wider output) work."""
    if backend == "triton":
        needs_interpreter()
    monkeypatch.setattr(chunks_torch, "CHUNK_BYTES_PER_THREAD", chunk_bytes)
    b = make_batch(
        gen,
        [(0, 30), (20, 1)],
        block_size=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
    )
    qkv = torch.randn(b.query.shape[0], 8, 64)
    qkv[:, :4] = b.query
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    wide = torch.full_like(qkv, float("nan"))
    kk.paged_attention(qkv[:, :4], b.kv_cache, meta, scale=0.1, out=wide[:, 4:], backend=backend)
    assert (wide[:, 4:].double() - reference_attention(b, scale=0.1)).abs().max() < 2e-5
    assert wide[:, :4].isnan().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_cache_view(gen, backend):
    """A cache that is a view (here every other head_dim half of a wider tensor) works."""
    if backend == "triton":
        needs_interpreter()
    b = make_batch(
        gen,
        CASES["mixed"],
        block_size=8,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
    )
    wide = torch.full((*b.kv_cache.shape[:-1], 128), float("nan"))
    wide[..., 32:96] = b.kv_cache
    view = wide[..., 32:96]
    assert not view.is_contiguous()
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    out = kk.paged_attention(b.query, view, meta, scale=0.1, backend=backend)
    assert (out.double() - reference_attention(b, scale=0.1)).abs().max() < 2e-5


def test_twin_long_decode(gen):
    check(gen, "torch", [(700, 1), (1030, 1), (5, 1)], num_q_heads=9, num_kv_heads=3)


def test_one_plan_serves_many_layers(gen):
    """The metadata is built once and reused with different caches, windows and features."""
    b = make_batch(
        gen,
        CASES["mixed"],
        block_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
    )
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 16)
    for feats in ({}, {"sliding_window": 5}, {}, {"soft_cap": 2.0}, {"sliding_window": 5}):
        out = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.1, backend="torch", **feats)
        err = (out.double() - reference_attention(b, scale=0.1, **feats)).abs().max().item()
        assert err < 2e-5


def test_requests_without_queries_and_empty_steps():
    gen = torch.Generator().manual_seed(1)
    b = make_batch(
        gen,
        [(10, 0), (4, 3), (9, 0)],
        block_size=8,
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        dtype=torch.float32,
    )
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    out = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.1)
    assert (out.double() - reference_attention(b, scale=0.1)).abs().max() < 2e-5
    empty = kk.plan_attention(
        [0], torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32), 8
    )
    q = torch.zeros(0, 2, 64)
    assert kk.paged_attention(q, b.kv_cache, empty, scale=0.1).shape == (0, 2, 64)


# ---- Triton under the interpreter: a subset always, the product marked slow ---------------------

ALWAYS = [
    dict(case="mixed", dtype=torch.float32, features={}),
    dict(case="mixed", dtype=torch.float16, features=FEATURES["all"]),
    dict(
        case="prefix_mid_block", dtype=torch.bfloat16, features={"sliding_window": 9}, block_size=8
    ),
    dict(
        case="decode",
        dtype=torch.float16,
        features={"alibi": True},
        num_q_heads=16,
        num_kv_heads=1,
        head_dim=128,
    ),
    dict(
        case="prefill",
        dtype=torch.float32,
        features={"soft_cap": 3.0},
        num_q_heads=9,
        num_kv_heads=3,
        head_dim=256,
        block_size=128,
    ),
    dict(case="mixed", dtype=torch.float32, features={"sliding_window": 4}, head_dim=32),
]


@pytest.mark.parametrize("params", ALWAYS, ids=lambda p: f"{p['case']}-{p['dtype']}-{len(p)}")
def test_triton_interpreter_subset(gen, params):
    needs_interpreter()
    params = dict(params)
    check(gen, "triton", CASES[params.pop("case")], **params)


def test_triton_interpreter_split_kv(gen, monkeypatch):
    """Few programs and long keys: the flash-decoding split and merge path."""
    needs_interpreter()
    from kvcore_kernels import splits_triton

    monkeypatch.setattr(splits_triton, "MIN_KEYS_PER_SPLIT", 16)
    assert splits_triton.choose_num_splits(2, 150, torch.device("cpu")) > 1
    check(
        gen,
        "triton",
        [(150, 1), (97, 1)],
        num_q_heads=4,
        num_kv_heads=1,
        dtype=torch.float16,
        features={"sliding_window": 120},
    )
    check(
        gen, "triton", [(40, 9), (0, 30)], num_q_heads=4, num_kv_heads=1, features=FEATURES["all"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("case", CASES)
def test_triton_interpreter_cases(gen, case, feature, dtype):
    needs_interpreter()
    check(gen, "triton", CASES[case], dtype=dtype, features=FEATURES[feature])


@pytest.mark.slow
@pytest.mark.parametrize(
    "head_dim,heads,block_size",
    list(itertools.product([64, 128, 256], [(4, 4), (12, 3), (16, 1)], [8, 32, 128]))[::2],
    ids=str,
)
def test_triton_interpreter_shapes(gen, head_dim, heads, block_size):
    needs_interpreter()
    check(
        gen,
        "triton",
        CASES["mixed"],
        block_size=block_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=torch.float16,
    )


# ---- CUDA -------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("feature", FEATURES)
def test_cuda_cases(gen, backend, dtype, feature):
    for case in CASES.values():
        check(gen, backend, case, dtype=dtype, device="cuda", features=FEATURES[feature])


# A spread of shapes rather than their product: each combination is one more Triton compile.
CUDA_SHAPES = [
    (64, (32, 8), 16),
    (128, (32, 8), 8),
    (256, (32, 8), 128),
    (128, (32, 32), 16),
    (128, (16, 1), 32),
    (64, (9, 3), 16),
    (256, (16, 1), 8),
    (128, (32, 8), 128),
]


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim, heads, block_size", CUDA_SHAPES, ids=str)
def test_cuda_shapes_and_splits(gen, head_dim, heads, block_size):
    """Long contexts and a lone long decode (split-KV) at bf16, against the float64 oracle."""
    reqs = random_reqs(gen, 8, 2000, 200) + [(5000, 1)]
    check(
        gen,
        "triton",
        reqs,
        block_size=block_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        features={"sliding_window": 2048} if head_dim == 128 else {},
    )
    check(
        gen,
        "triton",
        [(8000, 1)],
        block_size=block_size,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
    )
