"""MLA kernels on the paged latent cache: torch twin (absorbed, expanded, auto) and Triton
(interpreter on the CPU, CUDA when present) against a dense float64 reference that up-projects
K and V per head, for decode, prefill, prefix hits and mixed steps; the store; bad input.

Free slots and the null block hold NaN, and the output starts as NaN: a kernel that reads a slot
it must not, or leaves a row unwritten, fails.
"""

from __future__ import annotations

import kvcore_kernels as kk
import pytest
import torch
from kvcore_kernels import KernelConfigError

CASES = {
    # (tokens already cached, query tokens) per request
    "decode": [(30, 1), (7, 1), (64, 1), (1, 1), (15, 1)],
    "prefill": [(0, 37), (0, 5), (0, 16)],
    "prefix_mid_block": [(13, 22), (41, 17), (3, 1)],
    "mixed": [(0, 20), (17, 1), (33, 1), (5, 9), (40, 3), (0, 1)],
}
DIMS = dict(heads=4, r=32, rope=16, nope=16, v=24)  # v != nope + rope on purpose
TOL = {torch.float32: 3e-5, torch.bfloat16: 4e-2}


def make_step(
    gen, reqs, *, block_size=8, dtype=torch.float32, heads, r, rope, nope, v, device="cpu"
):
    """A random step: latents shuffled over the pool (free slots NaN), queries, weights."""
    seq_lens = [c + q for c, q in reqs]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 + sum(need)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(reqs), max(need) + 1, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, r + rope), float("nan"), dtype=dtype)
    lats = []
    for i, s in enumerate(seq_lens):
        blocks = [ids.pop() for _ in range(need[i])]
        table[i, : need[i]] = torch.tensor(blocks, dtype=torch.int32)
        lat = torch.randn(s, r + rope, generator=gen).to(dtype)
        pos = torch.arange(s)
        cache[torch.tensor(blocks)[pos // block_size], pos % block_size] = lat
        lats.append(lat)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in reqs]), 0)
    t = int(qsl[-1])
    q_nope = torch.randn(t, heads, nope, generator=gen).to(dtype)
    q_pe = torch.randn(t, heads, rope, generator=gen).to(dtype)
    w_uk = (torch.randn(heads, nope, r, generator=gen) * r**-0.5).to(dtype)
    w_uv = (torch.randn(heads, v, r, generator=gen) * r**-0.5).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = kk.plan_attention(qsl, lens, table, block_size, device=device)
    step = dict(q_nope=q_nope, q_pe=q_pe, cache=cache, w_uk=w_uk, w_uv=w_uv)
    return {**{k: t.to(device) for k, t in step.items()}, "meta": meta}, lats


def reference(step, lats, scale):
    """float64: per request, up-project every key's latent to per-head K, V; causal softmax."""
    w_uk, w_uv = step["w_uk"].cpu().double(), step["w_uv"].cpu().double()
    r = w_uk.shape[2]
    qn, qp = step["q_nope"].cpu().double(), step["q_pe"].cpu().double()
    out = torch.empty(qn.shape[0], qn.shape[1], w_uv.shape[1], dtype=torch.float64)
    qsl = step["meta"].host_query_start_loc
    for i, lat in enumerate(lats):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        lat = lat.double()
        k_nope = torch.einsum("sr,hdr->shd", lat[:, :r], w_uk)
        vals = torch.einsum("sr,hvr->shv", lat[:, :r], w_uv)
        s = torch.einsum("qhd,shd->hqs", qn[lo:hi], k_nope)
        s = (s + torch.einsum("qhd,sd->hqs", qp[lo:hi], lat[:, r:])) * scale
        q_pos = torch.arange(lat.shape[0] - (hi - lo), lat.shape[0])[:, None]
        s = s.masked_fill(torch.arange(lat.shape[0])[None] > q_pos, float("-inf"))
        out[lo:hi] = torch.einsum("hqs,shv->qhv", torch.softmax(s, -1), vals)
    return out


def _run(fn, step, **kw):
    heads, v, _ = step["w_uv"].shape
    out = torch.full(
        (step["meta"].num_tokens, heads, v),
        float("nan"),
        dtype=step["q_nope"].dtype,
        device=step["cache"].device,
    )
    res = fn(**step, scale=0.3, out=out, **kw)
    assert res is out
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("force", [None, "absorbed", "expanded"])
def test_twin_vs_reference(gen, case, force):
    step, lats = make_step(gen, CASES[case], **DIMS)
    out = _run(kk.mla_attention_torch, step, force=force)
    torch.testing.assert_close(out.double(), reference(step, lats, 0.3), atol=3e-5, rtol=3e-5)


def test_twin_bf16_and_dispatcher(gen):
    step, lats = make_step(gen, CASES["mixed"], dtype=torch.bfloat16, **DIMS)
    out = _run(kk.mla_attention, step, backend="torch")
    torch.testing.assert_close(out.double(), reference(step, lats, 0.3), atol=5e-2, rtol=5e-2)


def _triton_ok() -> bool:
    try:
        from kvcore_kernels.mla.attention_triton import _mla_decode_kernel
        from kvcore_kernels.triton_util import is_interpreted
    except ImportError:
        return False
    return torch.cuda.is_available() or is_interpreted(_mla_decode_kernel)


needs_triton = pytest.mark.skipif(not _triton_ok(), reason="no CUDA and no Triton interpreter")
# Where the Triton kernels run: CUDA when present, else CPU tensors under the interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [4, 20])  # 20: two head tiles, the second partly empty
def test_triton_vs_twin_and_reference(gen, case, heads):
    from kvcore_kernels import mla_attention_triton

    dims = {**DIMS, "heads": heads}
    step, lats = make_step(gen, CASES[case], device=TRITON_DEVICE, **dims)
    tri = _run(mla_attention_triton, step)
    twin = _run(kk.mla_attention_torch, step)
    ref = reference(step, lats, 0.3)
    torch.testing.assert_close(tri.cpu().double(), ref, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(tri, twin, atol=3e-5, rtol=3e-5)


@needs_triton
def test_triton_bf16(gen):
    from kvcore_kernels import mla_attention_triton

    step, lats = make_step(gen, CASES["mixed"], dtype=torch.bfloat16, device=TRITON_DEVICE, **DIMS)
    tri = _run(mla_attention_triton, step)
    ref = reference(step, lats, 0.3)
    torch.testing.assert_close(tri.cpu().double(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_store_latent(gen, backend):
    r, rope, bs = 12, 4, 4
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    cache = kk.allocate_latent_cache(6, bs, r, rope, torch.float32, dev)
    assert cache.shape == (6, bs, r + rope) and cache.element_size() * cache[0, 0].numel() == 64
    c_kv = torch.randn(5, r, generator=gen).to(dev)
    k_pe = torch.randn(5, rope, generator=gen).to(dev)
    slots = torch.tensor([5, 23, 2, -1, 9], device=dev)  # 2: null block, -1: padding
    store = kk.store_latent_torch if backend == "torch" else kk.store_latent_triton
    store(c_kv, k_pe, cache, slots)
    flat = cache.view(-1, r + rope)
    for t, s in enumerate(slots.tolist()):
        if s >= bs:
            torch.testing.assert_close(flat[s], torch.cat((c_kv[t], k_pe[t])))
    assert flat[:bs].abs().sum() == 0  # the null block is never written
    before = cache.clone()
    with pytest.raises(KernelConfigError, match="past"):
        store(c_kv, k_pe, cache, torch.tensor([5, 23, 2, -1, 24], device=dev))
    with pytest.raises(KernelConfigError, match="k_pe"):
        store(c_kv, k_pe[:, :3], cache, slots)
    assert torch.equal(cache, before)


def test_bad_input(gen):
    step, _ = make_step(gen, CASES["mixed"], **DIMS)
    bad = [
        (dict(q_pe=step["q_pe"][:, :, :3]), "q_pe"),
        (dict(q_nope=step["q_nope"].double()), "q_nope"),
        (dict(w_uv=step["w_uv"][:, :, :5]), "w_uv"),
        (dict(cache=step["cache"][:, :, :10]), "exceeds|q_pe"),
        (dict(cache=step["cache"][:1]), "blocks"),
        (dict(scale=float("nan")), "scale"),
        (dict(meta=None), "plan_attention"),
    ]
    for change, match in bad:
        args = {**step, "scale": 0.3, **change}
        with pytest.raises(KernelConfigError, match=match):
            kk.mla_attention(**args)
    with pytest.raises(KernelConfigError, match="force"):
        kk.mla_attention_torch(**step, scale=0.3, force="sideways")
    with pytest.raises(KernelConfigError, match="backend"):
        kk.mla_attention(**step, scale=0.3, backend="cuda")
    with pytest.raises(KernelConfigError, match="kv_lora_rank"):
        kk.allocate_latent_cache(4, 16, 0, 64, torch.float32, "cpu")
    assert kk.latent_bytes_per_token(512, 64, torch.bfloat16) == 1152


@pytest.mark.parametrize("case", ["mixed", "decode"])
def test_fp8_latent_store_and_attention(gen, case):
    from kvcore_kernels.mla.cache import FP8_MAX, fp8_row_bytes, fp8_views

    step, lats = make_step(gen, CASES[case], **DIMS)
    meta, bs = step["meta"], step["meta"].block_size
    r, rope = DIMS["r"], DIMS["rope"]
    width = r + rope
    cache = kk.allocate_latent_fp8_cache(step["cache"].shape[0], bs, r, rope, "cpu")
    assert cache.dtype == torch.uint8 and cache.shape[1] == fp8_row_bytes(bs, width)
    cache.fill_(0x7F)  # every code NaN and a garbage scale: whatever is not written must not leak
    table = meta.host_block_table
    # Write each request's latents in two steps, the second 4x larger: its blocks' scales grow
    # and their earlier codes are re-quantized.
    for i, lat in enumerate(lats):
        pos = torch.arange(lat.shape[0])
        slots = torch.from_numpy(table[i])[pos // bs].long() * bs + pos % bs
        half = lat.shape[0] // 2
        lat[half:] *= 4
        for lo, hi in ((0, half), (half, lat.shape[0])):
            if hi > lo:
                kk.store_latent(lat[lo:hi, :r], lat[lo:hi, r:], cache, slots[lo:hi])
    scales, codes = fp8_views(cache, bs, width)
    deq = codes.double() * scales.double()[:, None, None]
    stored = []
    for i, lat in enumerate(lats):
        pos = torch.arange(lat.shape[0])
        blocks = torch.from_numpy(table[i])[pos // bs].long()
        got = deq[blocks, pos % bs]
        amax = scales.double()[blocks] * FP8_MAX  # each block's scale covers its largest value
        assert (lat.double().abs().amax(1) <= amax * (1 + 1e-6)).all()
        assert ((got - lat.double()).abs() <= amax[:, None] / 8).all()  # FP8: 3 mantissa bits
        assert (got - lat.double()).abs().mean() / lat.double().abs().mean() < 0.06
        stored.append(got)
    fp8_step = {**step, "cache": cache}
    out = _run(kk.mla_attention, fp8_step)
    torch.testing.assert_close(out.double(), reference(step, stored, 0.3), atol=3e-5, rtol=3e-5)
    with pytest.raises(KernelConfigError, match="FP8"):
        kk.mla_attention_torch(**{**fp8_step, "q_pe": step["q_pe"][:, :, :4]}, scale=0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_deepseek_dims(gen, dtype):
    """On a GPU: DeepSeek-V3's latent (r 512, rope 64), 16 heads, long decodes and a prefill."""
    from kvcore_kernels import mla_attention_triton

    dims = dict(heads=16, r=512, rope=64, nope=128, v=128)
    reqs = [(1000, 1), (333, 1), (2047, 1), (0, 300), (700, 50)]
    step, lats = make_step(gen, reqs, block_size=16, dtype=dtype, device="cuda", **dims)
    tri = _run(mla_attention_triton, step)
    twin = _run(kk.mla_attention_torch, step)
    ref = reference(step, lats, 0.3)
    tol = 6e-2 if dtype == torch.bfloat16 else 2e-2
    torch.testing.assert_close(tri.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(tri.float(), twin.float(), atol=tol, rtol=tol)
