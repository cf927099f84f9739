"""Issue 17 item 6: the automatic mixed-precision plan keeps its own budget.

With a calibration text no longer than one prefill chunk, KIVI read no quantized KV, every layer
measured 0.00% and the plan put kivi2 everywhere, over budget. Now the sensitivity is measured
with a chunk that reads earlier steps, the assembled mix is verified and backed off, and a
one-step KIVI perplexity warns (the CLI refuses it).
"""

import numpy as np
import pytest
import torch
from kvcore.entrypoints.cli.plan import eval_kv_main
from kvcore.models.loader import tiny_llama
from kvcore.tools import mixed_precision
from kvcore.tools.eval_kv import PagedLM, perplexity
from kvcore.tools.mixed_precision import assign_mix, reading_chunk

TINY = dict(
    num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256,
)  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=0, **TINY)
    seqs = torch.randint(3, 256, (2, 96), generator=torch.Generator().manual_seed(0)).tolist()
    return PagedLM(model, block_size=16), seqs


def test_kivi_sensitivity_is_measured_on_a_short_calibration(setup):
    lm, seqs = setup
    calib = [seqs[0][:40]]  # 39 tokens fed: one step of the 256-token chunk
    with pytest.warns(UserWarning, match="KIVI reads no quantized KV"):
        one_step = perplexity(lm, "kivi2", calib, 256)
    assert one_step == pytest.approx(perplexity(lm, "auto", calib, 256), rel=1e-6)  # the bug
    assert reading_chunk(40, 256) == 10 and reading_chunk(400, 256) == 256
    mix = assign_mix(lm, calib, ["kivi2"], 1e9, chunk=256)
    assert mix.calib_chunk == 10
    assert mix.sensitivity["kivi2"].max() > 0.01  # quantized KV was read


def test_verification_backs_off_until_the_budget_holds(setup, monkeypatch):
    lm, seqs = setup
    base = perplexity(lm, "auto", seqs, 16)
    everywhere = 100 * (perplexity(lm, "kivi2", seqs, 16) / base - 1)
    budget = everywhere / 3
    assert budget > 0

    def blind(lm_, seqs_, candidates, *, chunk):  # the old failure: every layer reads 0.00%
        return 1.0, {c: np.zeros(lm_.num_layers) for c in candidates}

    monkeypatch.setattr(mixed_precision, "layer_sensitivity", blind)
    mix = assign_mix(lm, [seqs[0][:40]], ["kivi2"], budget, verify_seqs=seqs, verify_chunk=16)
    assert mix.backoffs >= 1 and mix.predicted_pct == 0.0
    assert mix.formats != ["kivi2"] * 3
    again = 100 * (perplexity(lm, mix.formats, seqs, 16) / base - 1)
    assert again == pytest.approx(mix.measured_pct, abs=1e-9) and again <= budget


def test_backing_off_moves_to_the_next_safer_candidate(setup, monkeypatch):
    lm, seqs = setup

    def ranked(lm_, seqs_, candidates, *, chunk):  # layer 2 looks most sensitive
        sens = {c: np.array([0.0, 0.0, 0.0]) for c in candidates}
        sens["int2"] = np.array([0.0, 0.0, 0.001])
        return 1.0, sens

    monkeypatch.setattr(mixed_precision, "layer_sensitivity", ranked)
    mix = assign_mix(lm, seqs, ["int8", "int2"], 0.0, verify_seqs=seqs, verify_chunk=16)
    assert mix.measured_pct <= 0.0
    # int2 everywhere was over a zero budget; layer 2 went to int8 first (the safer candidate)
    assert mix.backoffs >= 1 and mix.formats[2] in ("int8", "auto")


def test_eval_kv_refuses_a_one_step_kivi_perplexity(capsys):
    with pytest.raises(SystemExit) as exit_:
        eval_kv_main(["--formats", "kivi2", "--ppl-len", "256", "--chunk", "256"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ppl-len 256 must be at least --chunk + 2" in err[0]
