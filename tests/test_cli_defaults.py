"""Defaults a newcomer relies on: the device, the model's sampling defaults, the KV pool size."""

import pytest
import torch
from kvcore.config import (
    DEFAULT_KV_MEMORY_BYTES,
    available_memory_bytes,
    blocks_for_request,
    default_kv_memory_bytes,
    resolve_device,
)
from kvcore.engine.generation_defaults import default_sampling_params, model_sampling_defaults
from kvcore.errors import InvalidArgumentError
from kvcore.tools.report import RunSummary, format_table, rows_json
from transformers import GenerationConfig

NO_CUDA = not torch.cuda.is_available()


def test_resolve_device_cpu_and_default():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    want = torch.device("cuda", torch.cuda.current_device()) if not NO_CUDA else torch.device("cpu")
    assert resolve_device(None) == want


@pytest.mark.parametrize("bad", ["tpu", "mps", "", "cuda:x", 5, True, 1.5])
def test_resolve_device_refuses_unknown_devices(bad):
    with pytest.raises(InvalidArgumentError):
        resolve_device(bad)


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
@pytest.mark.parametrize(
    "dev", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=["plain", "index", "device"]
)
def test_resolve_device_refuses_a_missing_gpu(dev):  # no "cuda" in the name: conftest skips it
    with pytest.raises(InvalidArgumentError, match="CUDA is not available"):
        resolve_device(dev)


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_resolve_device_normalises_cuda():
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(InvalidArgumentError):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_sampling_defaults_come_from_the_generation_config():
    cfg = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1
    )
    p = default_sampling_params(cfg)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    p = default_sampling_params(cfg, temperature=0.0, top_p=None, max_tokens=7)
    assert p.temperature == 0.0 and p.top_p == 0.9 and p.max_tokens == 7  # flags override
    assert model_sampling_defaults({"do_sample": False, "temperature": 0.7})["temperature"] == 0
    assert model_sampling_defaults({"top_k": 0, "max_new_tokens": 50}) == {
        "top_k": -1,
        "max_tokens": 50,
    }


def test_a_model_that_says_nothing_samples_at_temperature_one():
    from kvcore.models.loader import tiny_llama

    model = tiny_llama(num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64)  # fmt: skip
    assert model_sampling_defaults(model) == {}
    p = default_sampling_params(model)
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1
    with pytest.raises(InvalidArgumentError):
        default_sampling_params(model, temprature=0.5)
    with pytest.raises(InvalidArgumentError):
        default_sampling_params(model, temperature=-1.0)


def test_request_sized_pool():
    assert blocks_for_request(10, 22, 16) == 8  # 2 blocks + null + spare + watermark -> 8
    assert blocks_for_request(1000, 1000, 16, n=4) % 8 == 0
    assert blocks_for_request(1000, 1000, 16, n=4) >= 1 + 4 * 125 + 1 + 6
    with pytest.raises(InvalidArgumentError):
        blocks_for_request(0, 1, 16)


def test_default_pool_is_capped_by_ram():
    budget = default_kv_memory_bytes(torch.device("cpu"))
    assert 0 < budget <= DEFAULT_KV_MEMORY_BYTES
    avail = available_memory_bytes()
    if avail is not None:
        assert budget <= max(1 << 20, avail // 4 + 1)


def test_report_table_lines_and_json():
    s = RunSummary(2, 10, 2.0, [0.5, 0.7], [0.1], {"steps": 5, "peak_kv_usage_pct": 1.23456})
    rows = s.rows("kvcore")
    assert "kvcore_tok_per_s: 5.0 tok/s" in s.lines()
    assert "kvcore_peak_kv_usage_pct: 1.235 %" in s.lines()
    table = format_table(rows, "kvcore run")
    assert "output throughput" in table and "kvcore_" not in table
    js = rows_json(rows)
    assert js["kvcore_requests"] == {"value": 2, "unit": "req", "what": "requests finished"}
