"""Sliding-window models (Mistral, Qwen2/Qwen3 with window layers, Gemma 2, Gemma 3 hybrid), tiny
and seeded, through kvcore's engine with ``retention="full"`` (every block kept, windows applied
by the kernels): greedy tokens equal transformers' ``generate`` with 80-token prompts over a
16-token window, chunked prefill, prefix hits and decode past the window; the window each layer
receives is the one ``kvcore.models.windows.layer_windows`` reports; and dropping the window changes
the tokens (so the equality is not vacuous)."""

import inspect

import kvcore_kernels
import pytest
import torch
from hf_reference import hf_greedy
from kvcore import InvalidArgumentError
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import MODEL_NAMES, check_supported, load_model
from kvcore.models.tiny import TINY_WINDOW, TINY_WINDOW_MODELS, tiny_window_model
from kvcore.models.windows import layer_windows, visible_tokens, window_groups
from kvcore.tools.planner import geometry
from kvcore_kernels import cpu_native
from test_engine import VOCAB, _greedy, _prompts

# retention="full" (every block kept) once LLM takes a retention policy (issue 12): these tests
# are its correctness gate on windowed models; before that, the engine's only behaviour.
FULL = {"retention": "full"} if "retention" in inspect.signature(LLM.__init__).parameters else {}
WINDOW = 16
SHRINK = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    sliding_window=WINDOW,
)
# The shrunk families and the windows their 4 layers must apply.
FAMILIES = {
    "tiny-mistral": ({}, (WINDOW,) * 4),
    "tiny-qwen2": (dict(max_window_layers=2), (None, None, WINDOW, WINDOW)),
    "tiny-qwen3": (dict(max_window_layers=1), (None, WINDOW, WINDOW, WINDOW)),
    "tiny-gemma2": (dict(query_pre_attn_scalar=16), (WINDOW, None, WINDOW, None)),
    "tiny-gemma3": (
        dict(
            query_pre_attn_scalar=16,
            num_key_value_heads=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention"],
        ),
        (WINDOW, WINDOW, None, WINDOW),
    ),
}


def _small(name, seed=5, **extra):
    return tiny_window_model(name, seed=seed, **{**SHRINK, **FAMILIES[name][0], **extra})


def _reference(model, prompt, max_tokens):
    """transformers' greedy generate with its own masks (eager: Gemma 2's soft-capping)."""
    return hf_greedy(model, prompt, max_tokens, attn="eager", pad_token_id=0)


def _wrap_attention(monkeypatch, wrap):
    """Route every paged attention call through ``wrap(kwargs)`` (which may change them): the
    checked entry point ``kvcore_kernels.paged_attention``, and the native kernel's
    ``cpu_native.run`` where a step's ``LayerCalls`` goes to it straight (the checked calls
    reach it too: those are wrapped once, at the entry point)."""
    inside = []
    real, real_run = kvcore_kernels.paged_attention, cpu_native.run

    def entry(*args, **kwargs):
        inside.append(1)
        try:
            return real(*args, **wrap(kwargs))
        finally:
            inside.pop()

    def run(*args, **kwargs):
        return real_run(*args, **(kwargs if inside else wrap(kwargs)))

    monkeypatch.setattr(kvcore_kernels, "paged_attention", entry)
    monkeypatch.setattr(cpu_native, "run", run)


@pytest.fixture
def recorded(monkeypatch):
    """Every (sliding_window, soft_cap) the paged attention kernel is called with, in order."""
    calls = []

    def record(kwargs):
        calls.append((kwargs.get("sliding_window"), kwargs.get("soft_cap")))
        return kwargs

    _wrap_attention(monkeypatch, record)
    return calls


def _run(model, prompts, max_tokens, **kw):
    kw = {"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 24, **FULL, **kw}
    llm = LLM(model, **kw)
    outs = llm.generate(prompts, [_greedy(m) for m in max_tokens], use_tqdm=False)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.all_blocks_free()
    engine.scheduler.check_invariants()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_window_family_matches_generate(name, recorded):
    model = _small(name)
    windows = FAMILIES[name][1]
    assert layer_windows(model.config) == windows
    assert geometry(model.config).windows == windows  # the planner reads the same layout
    shared = _prompts([12], seed=31)[0]
    # 80 tokens: five windows long; the shared prefix gives a prefix hit; one prompt < window.
    prompts = _prompts([68, 30], seed=32, prefix=shared) + _prompts([5, 80], seed=33)
    max_tokens = [24, 20, 12, 30]
    llm, got = _run(model, prompts, max_tokens)
    assert llm.engine.scheduler.stats().prefix_hit_tokens > 0
    assert llm.engine.runner.layer_windows == windows
    cap = getattr(model.config, "attn_logit_softcapping", None)
    assert recorded[: len(windows)] == [(w, cap) for w in windows]  # layer order, one forward
    for tokens, p, m in zip(got, prompts, max_tokens, strict=True):
        assert tokens == _reference(model, p, m), name


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-gemma3"])
def test_without_the_window_the_tokens_differ(name, monkeypatch):
    """The equality above depends on the window: the same engine with the window dropped
    (every layer global) no longer matches generate on the long prompts."""
    model = _small(name)
    prompts = _prompts([80, 64], seed=34)
    _wrap_attention(monkeypatch, lambda kwargs: {**kwargs, "sliding_window": None})
    _, got = _run(model, prompts, [24, 24])
    assert any(t != _reference(model, p, 24) for t, p in zip(got, prompts, strict=True))


@pytest.mark.parametrize("block_size", [16, 8])
def test_window_not_a_multiple_of_the_block(block_size):
    """A 13-token window cuts blocks in the middle: the kernels mask inside a block."""
    model = _small("tiny-gemma3", seed=6, sliding_window=13)
    prompts = _prompts([80, 41], seed=35)
    _, got = _run(model, prompts, [20, 28], block_size=block_size, max_num_batched_tokens=32)
    for tokens, p, m in zip(got, prompts, [20, 28], strict=True):
        assert tokens == _reference(model, p, m)


def test_named_tiny_models_and_their_windows():
    for name in ("tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"):
        assert name in MODEL_NAMES and name in TINY_WINDOW_MODELS
    model, tok = load_model("tiny-gemma3", seed=2)
    assert tok is None and type(model).__name__ == "Gemma3ForCausalLM"
    windows = layer_windows(model.config)
    assert windows == (TINY_WINDOW,) * 5 + (None,)
    assert window_groups(windows) == {TINY_WINDOW: [0, 1, 2, 3, 4], None: [5]}
    assert visible_tokens(windows) is None  # a global layer sees the whole history
    assert visible_tokens(layer_windows(tiny_window_model("tiny-mistral").config)) == TINY_WINDOW
    w = "model.layers.0.self_attn.q_proj.weight"
    again = tiny_window_model("tiny-gemma3", seed=2).state_dict()[w]
    other = tiny_window_model("tiny-gemma3", seed=3).state_dict()[w]
    assert torch.equal(model.state_dict()[w], again) and not torch.equal(again, other)
    with pytest.raises(InvalidArgumentError, match="unknown tiny model"):
        tiny_window_model("tiny-gpt")


def test_full_attention_models_report_no_windows():
    from transformers import LlamaConfig, Qwen2Config

    assert layer_windows(LlamaConfig(num_hidden_layers=3)) == (None,) * 3
    # Qwen2 keeps sliding_window off unless use_sliding_window: every layer global.
    assert layer_windows(Qwen2Config(num_hidden_layers=3, sliding_window=8)) == (None,) * 3


def test_bidirectional_gemma3_is_refused():
    model = _small("tiny-gemma3", use_bidirectional_attention=True)
    with pytest.raises(InvalidArgumentError, match="bidirectional"):
        check_supported(model)
