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
