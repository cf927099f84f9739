"""benches/bench_vs_vllm_cpu.py's GEMM floor: the FLOP count it divides by the machine's best
GEMM rate must be the model's own linear layers, counted here from the weights themselves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import bench_vs_vllm_cpu as b  # noqa: E402
from kvcore.models.loader import tiny_llama  # noqa: E402
from kvcore.models.tiny import tiny_window_model  # noqa: E402


def _model(name: str) -> nn.Module:
    if name == "tiny-llama":
        return tiny_llama(seed=1)
    return tiny_window_model(name, seed=1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_gemm_flops_are_the_models_linear_layers(name: str) -> None:
    hf = _model(name)
    head = hf.get_output_embeddings()
    body = [m for m in hf.modules() if isinstance(m, nn.Linear) and m is not head]
    assert body, "no linear layers found"
    per_token = sum(m.in_features * m.out_features for m in body)
    last = hf.model.layers[-1]
    qkv = (last.self_attn.q_proj, last.self_attn.k_proj, last.self_attn.v_proj)
    # the last layer runs its o_proj and MLP on the sampled rows only
    after_attn = sum(
        m.in_features * m.out_features
        for m in last.modules()
        if isinstance(m, nn.Linear) and all(m is not p for p in qkv)
    )
    fed, sampled = 1_000, 37
    want = 2 * (
        fed * per_token
        - (fed - sampled) * after_attn
        + sampled * head.in_features * head.out_features
    )
    assert b.gemm_flops(hf.config, fed, sampled) == want


def test_gemm_peak_is_a_measured_rate() -> None:
    hf = tiny_llama(seed=1)
    rate = b.gemm_peak_gflops(hf.config, rows=64, rounds=2)
    assert 0 < rate < 1e5  # GFLOP/s of a real GEMM on this machine


def test_rounds_change_the_first_token_only_and_keep_a_shared_prefix_shared() -> None:
    prompts = b.workload("shared", 3, 6)
    seen = set()
    for rnd in range(4):
        rp = [[b.first_token(p[0], rnd)] + p[1:] for p in prompts]
        if rnd == 0:
            assert rp == prompts
        assert all(100 <= p[0] < 49152 for p in rp)
        assert len({tuple(p[:512]) for p in rp}) == 1  # the prefix is still one prefix
        assert all(p[1:] == q[1:] for p, q in zip(rp, prompts, strict=True))
        seen.add(rp[0][0])
    assert len(seen) == 4  # no round meets another's prefix-cache entries
    firsts = [p[0] for p in b.workload("random", 3, 48)]
    for rnd in range(3):
        moved = [b.first_token(t, rnd) for t in firsts]
        assert len(set(moved)) == len(set(firsts))  # distinct prompts stay distinct


def test_median_run_and_per_round_ratios() -> None:
    kv = [{"tok_s": 60.0}, {"tok_s": 66.0}, {"tok_s": 63.0}]
    vl = [{"tok_s": 50.0}, {"tok_s": 44.0}, {"tok_s": 45.0}]
    assert b.median_run(kv)["tok_s"] == 63.0
    assert b.median_run(kv[:2])["tok_s"] == 60.0  # the lower middle of an even count
    runs = {"kvcore-eager-1t": kv, "vllm-float32-1t": vl}
    lo, hi = b.per_round_ratios(runs, 3)["1thread"]
    assert lo == pytest.approx(60 / 50) and hi == pytest.approx(66 / 44)
    assert b.per_round_ratios(runs, 1) == {}
    assert b.per_round_ratios({"kvcore-eager-1t": kv}, 3) == {}  # no peer: no ratio
