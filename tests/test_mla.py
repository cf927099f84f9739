"""MLA (DeepSeek-V2/V3) on kvcore's paged latent cache, token for token against transformers'
``generate`` on tiny random models (MoE layers included): chunked prefill, prefix hits,
preemption, n > 1; the latent allocation's exact size; decode stays absorbed; unsupported
features fail at load, by name."""

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy
from kvcore import InvalidArgumentError
from kvcore.entrypoints.llm import LLM
from kvcore.models.mla import tiny_deepseek
from kvcore.models.sizes import mha_equivalent_bytes_per_token
from kvcore.params import SamplingParams
from kvcore.runner.mla import MLAAttention
from kvcore_kernels.mla import attention_torch as mla_torch

VOCAB = 256
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,  # layer 0 dense, layers 1-2 MoE
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module", params=["v2", "v3"])
def model(request):
    extra = dict(q_lora_rank=None) if request.param == "v2" else dict(q_lora_rank=48)
    return tiny_deepseek(request.param, seed=5, **SMALL, **extra)


def _prompts(lengths, seed=0, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _hf_greedy(model, prompt, max_tokens):
    return hf_greedy(model, prompt, max_tokens, pad_token_id=0)


def _greedy(n_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, **kw)


def _llm(model, **kw):
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(model, **kw)


def _check(llm):
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_invariants()
    assert llm.engine.all_blocks_free()


def test_chunked_prefill_mixed_lengths_match_generate(model):
    prompts = _prompts([3, 17, 40, 9, 64, 1])
    max_tokens = [12, 5, 20, 1, 9, 15]
    llm = _llm(model, max_num_batched_tokens=24)  # long prompts split beside running decodes
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in model.model.layers)
    outs = llm.generate(prompts, [_greedy(m) for m in max_tokens], use_tqdm=False)
    for o, p, m in zip(outs, prompts, max_tokens, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, p, m)
    assert all(c.abs().sum() > 0 for c in llm.engine.runner.kv_caches)  # the latent was written
    _check(llm)


def test_prefix_hits_match_generate(model):
    shared = _prompts([30], seed=1)[0]
    first = _prompts([5, 9], seed=2, prefix=shared)
    second = _prompts([7, 3, 12], seed=3, prefix=shared)
    llm = _llm(model, prefix_caching="radix")
    llm.generate(first, _greedy(6), use_tqdm=False)
    outs = llm.generate(second, _greedy(6), use_tqdm=False)
    assert llm.engine.scheduler.stats().prefix_hit_tokens >= 3 * 28
    for o, p in zip(outs, second, strict=True):
        assert o.num_cached_tokens >= 28
        assert o.outputs[0].token_ids == _hf_greedy(model, p, 6)
    _check(llm)


def test_preemption_and_n_samples_match_generate(model):
    prompts = _prompts([20, 25, 30, 18, 22], seed=4)
    llm = _llm(model, num_blocks=25, max_num_batched_tokens=64)  # 24 usable blocks of 4
    outs = llm.generate(prompts, _greedy(24), use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for o, p in zip(outs, prompts, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, p, 24)
    _check(llm)
    forked = _prompts([10, 14], seed=5)
    outs = _llm(model).generate(forked, _greedy(9, n=3), use_tqdm=False)
    for o, p in zip(outs, forked, strict=True):
        ref = _hf_greedy(model, p, 9)
        assert [c.token_ids for c in o.outputs] == [ref] * 3


def test_latent_allocation_is_exact_and_sizes_the_pool(model):
    cfg = model.config
    per_token_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32
    llm = LLM(model, block_size=16, kv_memory_bytes=1 << 20)
    runner = llm.engine.runner
    assert len(runner.kv_caches) == cfg.num_hidden_layers
    for cache in runner.kv_caches:
        assert cache.shape == (runner.num_blocks, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert cache.untyped_storage().nbytes() == runner.num_blocks * 16 * per_token_layer
    per_token = per_token_layer * cfg.num_hidden_layers
    assert runner.kv_cache_bytes == runner.num_blocks * 16 * per_token
    assert runner.num_blocks == (1 << 20) // (16 * per_token)  # the pool sized from the latent
    mha = mha_equivalent_bytes_per_token(cfg, torch.float32)
    assert mha == cfg.num_hidden_layers * 4 * (16 + 8 + 16) * 4


def test_decode_is_absorbed(model, monkeypatch):
    seen = []
    real = mla_torch.expand_pays

    def spy(r, nope, v, rope, q_len, key_len):
        seen.append(q_len)
        return real(r, nope, v, rope, q_len, key_len)

    monkeypatch.setattr(mla_torch, "expand_pays", spy)
    llm = _llm(model)
    llm.generate(_prompts([100]), _greedy(4), use_tqdm=False)
    assert seen and 1 not in seen  # decode chunks never even ask: always absorbed


def test_unsupported_features_fail_at_load_by_name():
    dyn = tiny_deepseek(
        "v3",
        **{**SMALL, "num_hidden_layers": 1},
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(InvalidArgumentError, match="rope_type 'dynamic'"):
        LLM(dyn, num_blocks=16)
    ok = tiny_deepseek("v2", **{**SMALL, "num_hidden_layers": 1})
    with pytest.raises(InvalidArgumentError, match="kv_format 'int8'"):
        LLM(ok, num_blocks=16, kv_format="int8")
    with pytest.raises(InvalidArgumentError, match="model dtype"):
        LLM(ok, num_blocks=16, kv_format="float16")


def test_fp8_latent_serves_with_exact_allocation(model):
    from kvcore_kernels.mla.cache import fp8_row_bytes

    cfg = model.config
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    prompts = _prompts([20, 25, 30, 18, 22], seed=4)
    ref = _llm(model).generate(prompts, _greedy(12), use_tqdm=False)
    # Small pool (preemption) and a 24-token budget (chunked prefill) on FP8 latents.
    llm = _llm(model, kv_format="fp8_e4m3", num_blocks=25, max_num_batched_tokens=24)
    runner = llm.engine.runner
    for cache in runner.kv_caches:  # codes + one float32 scale per block, nothing else
        assert cache.dtype == torch.uint8
        assert cache.untyped_storage().nbytes() == runner.num_blocks * fp8_row_bytes(4, width)
    assert fp8_row_bytes(4, width) == 4 * width + 4
    outs = llm.generate(prompts, _greedy(12), use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    _check(llm)
    # Lossy: FP8 may flip a near-tie, but most greedy continuations stay the model dtype's.
    got = [o.outputs[0].token_ids for o in outs]
    want = [o.outputs[0].token_ids for o in ref]
    assert [g[0] for g in got] == [w[0] for w in want]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 2


def test_yarn_mscale_and_plain_rope_layout_match_generate():
    # YaRN with mscale_all_dim: transformers folds mscale^2 into the softmax scale and an
    # attention factor into cos/sin; V3 without rope_interleave rotates halves, not pairs.
    rope = dict(
        rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=128,
        mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
    )  # fmt: skip
    m = tiny_deepseek(
        "v3", seed=9, **{**SMALL, "num_hidden_layers": 2}, q_lora_rank=48,
        rope_parameters=rope, rope_interleave=False,
    )  # fmt: skip
    assert m.model.layers[0].self_attn.scaling != (16 + 8) ** -0.5  # mscale applied
    prompts = _prompts([40, 7, 150], seed=6)
    outs = _llm(m, max_num_batched_tokens=32).generate(prompts, _greedy(10), use_tqdm=False)
    for o, p in zip(outs, prompts, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(m, p, 10)
