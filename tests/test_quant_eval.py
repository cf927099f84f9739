"""The quality-gate driver on a tiny random Llama: the model-dtype paged run reproduces
transformers exactly, the metrics order formats sensibly, the automatic mix respects its budget."""

import numpy as np
import pytest
import torch
from kvcore.errors import InvalidArgumentError
from kvcore.models.loader import tiny_llama
from kvcore.tools.eval_kv import (
    PagedLM,
    agreement,
    greedy_reference,
    layer_errors,
    needle,
    needle_prompts,
    perplexity,
)
from kvcore.tools.mixed_precision import assign_mix

TINY = dict(
    num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=0, **TINY)
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, 256, (2, 48), generator=gen).tolist()
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        logits = model(torch.tensor(seqs), use_cache=False).logits.float()
    lm = PagedLM(model, block_size=16)
    return lm, seqs, logits


def test_model_dtype_paged_run_equals_transformers(setup):
    lm, seqs, ref = setup
    caches = lm.caches("auto", 2, 48, 20)
    rows = [[], []]
    for start in range(0, 48, 20):  # chunked prefill, both sequences packed in one row
        parts = [s[start : start + 20] for s in seqs]
        out = lm.step(caches, [start, start], parts)
        rows[0].append(out[: len(parts[0])])
        rows[1].append(out[len(parts[0]) :])
    for r in range(2):
        assert torch.allclose(torch.cat(rows[r]), ref[r], atol=1e-4)
    nll = torch.nn.functional.cross_entropy(
        ref[:, :-1].reshape(-1, 256), torch.tensor(seqs)[:, 1:].reshape(-1)
    )
    assert perplexity(lm, "auto", seqs, 16) == pytest.approx(float(nll.exp()), rel=1e-4)


def test_metrics_order_formats(setup):
    lm, seqs, _ = setup
    prompts = [s[:8] for s in seqs] + [s[10:20] for s in seqs]
    reference = greedy_reference(lm, prompts, 12)
    assert agreement(lm, "auto", prompts, reference) == 1.0
    assert agreement(lm, "int8", prompts, reference) >= agreement(lm, "int2", prompts, reference)
    errs = layer_errors(lm, {"int8": "int8", "int2": "int2", "kivi2": "kivi2"}, seqs[0], 16)
    assert (errs["int8"] < 0.02).all() and (errs["int8"] < errs["int2"]).all()
    assert errs["kivi2"].shape == (3,)
    mix = ["auto", "int8", "kivi2"]
    assert np.isfinite(perplexity(lm, mix, seqs, 16))


def test_assign_mix_respects_the_budget(setup):
    lm, seqs, _ = setup
    loose = assign_mix(lm, seqs[:1], ["int8", "int2"], 1e9, chunk=16)
    assert loose.formats == ["int2"] * 3  # everything fits: the cheapest everywhere
    tight = assign_mix(lm, seqs[:1], ["int8", "int2"], 0.5, chunk=16)
    assert len(tight.formats) == 3 and tight.measured_pct <= 0.5
    assert tight.bytes_per_token >= loose.bytes_per_token
    assert set(tight.sensitivity) == {"int8", "int2"}
    with pytest.raises(InvalidArgumentError):
        assign_mix(lm, seqs[:1], [], 1.0)


class CharTokenizer:
    """Bytes as token ids (the tiny model has no tokenizer)."""

    def __call__(self, text):
        class Enc:
            input_ids = [3 + b % 250 for b in text.encode()]

        return Enc()

    def decode(self, ids):
        return "".join(chr(i - 3) if 3 <= i < 253 else "?" for i in ids)


def test_needle_runs_ragged_lengths_and_checks_the_key(setup):
    lm, seqs, _ = setup
    tok = CharTokenizer()
    corpus = tok("the quick brown fox jumps over the lazy dog. " * 20).input_ids
    cases = needle_prompts(tok, corpus, [200, 330], seed=1)
    assert [len(p) for p, _ in cases] == [200, 330]
    ok = needle(lm, tok, "int8", cases, chunk=64)
    assert len(ok) == 2 and all(isinstance(x, bool) for x in ok)  # a random model: any answer
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        needle_prompts(tok, corpus, [5000], seed=1)
