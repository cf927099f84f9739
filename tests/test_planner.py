"""Capacity planner: bytes per token by hand for MHA / GQA / MQA / MLA / sliding windows, budgets,
the CLI, and bad input."""

import json

import pytest
import torch
from kvcore.entrypoints.cli.plan import plan_main
from kvcore.errors import InvalidArgumentError
from kvcore.tools.planner import geometry, parse_memory, plan_capacity
from kvcore_kernels.quant import block_layout, get_format

SMOLLM2 = dict(
    model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    hidden_size=576, head_dim=64, torch_dtype="bfloat16", max_position_embeddings=8192,
)  # fmt: skip
LLAMA3_8B = dict(
    model_type="llama", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    hidden_size=4096, torch_dtype="bfloat16", max_position_embeddings=8192,
)  # fmt: skip


def _row(rows, name):
    return next(r for r in rows if r.format == name)


def test_bytes_per_token_by_hand():
    _, rows = plan_capacity(LLAMA3_8B, "80GiB", formats=["auto", "int8", "int4", "kivi2"])
    assert _row(rows, "auto").bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB
    # int8: 128 codes + an fp16 scale per token, head and K/V.
    assert _row(rows, "int8").bytes_per_token == 32 * 2 * 8 * (128 + 2)
    layout = block_layout(get_format("kivi2"), 16, 8, 128)
    assert _row(rows, "kivi2").bytes_per_token == 32 * layout.block_bytes / 16
    assert _row(rows, "int4").ratio_vs_fp16 <= 0.30
    assert _row(rows, "kivi2").ratio_vs_fp16 <= 0.19


def test_mha_mqa_mla_and_aliases():
    mha = geometry(dict(n_layer=12, n_head=12, n_embd=768))  # GPT-2 names
    assert (mha.num_layers, mha.num_kv_heads, mha.head_dim) == (12, 12, 64)
    mqa = geometry(
        dict(num_hidden_layers=32, num_attention_heads=71, hidden_size=4544, multi_query=True)
    )
    assert mqa.num_kv_heads == 1
    mla = dict(
        num_hidden_layers=61, num_attention_heads=128, hidden_size=7168, kv_lora_rank=512,
        qk_rope_head_dim=64, torch_dtype="bfloat16",
    )  # fmt: skip
    _, rows = plan_capacity(mla, "80GiB", formats=["auto", "fp8_e4m3"], context_len=1024)
    assert _row(rows, "auto").bytes_per_token == 61 * 576 * 2  # one latent, not K and V
    assert _row(rows, "fp8_e4m3").bytes_per_token == 61 * (576 + 4 / 16)  # + a block scale
    with pytest.raises(InvalidArgumentError, match="MLA"):
        plan_capacity(mla, "1GiB", formats=["kivi2"])


def test_sliding_window_layers_and_budget_arithmetic():
    gemma2 = dict(
        model_type="gemma2", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, hidden_size=2304, sliding_window=4096, torch_dtype="float16",
        max_position_embeddings=8192,
    )  # fmt: skip
    g = geometry(gemma2)
    assert g.windows == (4096, None, 4096, None)
    typed = geometry({**gemma2, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]})
    assert typed.windows == (None, None, None, 4096)
    _, rows = plan_capacity(gemma2, "1GiB", formats=["auto"], context_len=8192)
    r = rows[0]
    per_block = 16 * r.bytes_per_token
    assert r.max_tokens == (int((1 << 30) // per_block) - 1) * 16
    assert r.max_requests == int(((1 << 30) - per_block) // (512 * per_block))
    assert r.max_requests_windowed > r.max_requests  # sliding layers hold ~half the context


def test_kivi_residual_counted_per_request():
    _, rows = plan_capacity(SMOLLM2, "8GiB", formats=["kivi2", "int2"], context_len=4096)
    k, p = _row(rows, "kivi2"), _row(rows, "int2")
    assert k.bytes_per_token == p.bytes_per_token and k.max_requests < p.max_requests
    _, wide = plan_capacity(SMOLLM2, "8GiB", formats=["kivi2"], context_len=4096, kivi_window=8)
    assert wide[0].max_requests < k.max_requests


def test_mixed_list_and_memory_units():
    mix = ["int8"] * 15 + ["kivi2"] * 15
    _, rows = plan_capacity(SMOLLM2, "1GiB", formats=[mix, "int8", "kivi2"])
    assert rows[0].format == "mixed"
    assert rows[0].bytes_per_token == pytest.approx(
        (rows[1].bytes_per_token + rows[2].bytes_per_token) / 2
    )
    assert parse_memory("8GiB") == 8 << 30 and parse_memory("8G") == 8 << 30
    assert parse_memory("8GB") == 8 * 10**9 and parse_memory("512MiB") == 512 << 20
    with pytest.raises(InvalidArgumentError):
        parse_memory("eight")
    with pytest.raises(InvalidArgumentError, match="needs 30 entries"):
        plan_capacity(SMOLLM2, "1GiB", formats=[["int8"] * 29])
    with pytest.raises(InvalidArgumentError, match="unknown KV format"):
        plan_capacity(SMOLLM2, "1GiB", formats=["int3"])


def test_plan_cli_prints_the_table(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMOLLM2))
    assert plan_main(["--config", str(path), "--memory", "8GiB", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "30 layers, 3 KV heads x 64 (GQA)" in out
    line = next(x for x in out.splitlines() if x.startswith("float16"))
    assert "23040.0" in line and "1.000" in line  # 30 * 2 * 3 * 64 * 2 bytes
    assert plan_main(["--config", str(tmp_path / "missing.json"), "--memory", "1GiB"]) == 2
    assert "cannot read a model config" in capsys.readouterr().err


def test_auto_format_follows_the_config_dtype():
    _, rows = plan_capacity({**SMOLLM2, "torch_dtype": "float32"}, "1GiB", formats=["auto"])
    assert rows[0].ratio_vs_fp16 == 2.0
    assert torch.float32 == geometry({**SMOLLM2, "torch_dtype": "float32"}).dtype


def test_mla_beside_its_mha_equivalent(tmp_path, capsys):
    from kvcore.tools.planner import format_table, mha_equivalent_bytes_per_token

    v3 = dict(
        model_type="deepseek_v3", num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, hidden_size=7168, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, head_dim=64, torch_dtype="bfloat16",
    )  # fmt: skip
    geom, rows = plan_capacity(v3, "80GiB", formats=["auto"], context_len=4096)
    assert geom.mla_dim == 576 and geom.mha_equivalent_dim == 128 * (128 + 64 + 128)
    assert _row(rows, "auto").bytes_per_token == 61 * 576 * 2
    assert mha_equivalent_bytes_per_token(geom) == 61 * 40960 * 2
    assert "MHA-equivalent" in format_table(geom, rows, 80 << 30) and "71.1x" in format_table(
        geom, rows, 80 << 30
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(v3))
    assert plan_main(["--config", str(path), "--memory", "80GiB", "--formats", "auto"]) == 0
    assert "576 values per layer per token" in capsys.readouterr().out
