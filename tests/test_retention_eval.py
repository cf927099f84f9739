"""Retention policies on a real paged run: block selection, streaming with released blocks,
the H2O mass, and ``kvcore eval-kv --retention`` on the tiny random Llama."""

import numpy as np
import pytest
import torch
from kvcore.eval_kv import PagedLM, perplexity
from kvcore.eval_retention import ByteTokenizer, Streamer, needle, needle_cases, stream_perplexity
from kvcore.models import tiny_llama
from kvcore.quant_cli import eval_kv_main
from kvcore.retention import RetentionError, blocks_to_release, parse_retention

BS = 4
TINY = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300,
)  # fmt: skip


def release(spec, num_tokens, live=None, mass=None):
    n = -(-num_tokens // BS)
    live = np.ones(n, dtype=bool) if live is None else np.asarray(live)
    return blocks_to_release(parse_retention(spec), num_tokens, BS, live, mass).tolist()


def test_window_and_sinks_keep_the_right_blocks():
    # 30 tokens: blocks 0..6 full, block 7 being written (2 tokens)
    assert release("full", 30) == []
    assert release("window:8", 30) == [0, 1, 2, 3, 4]  # blocks 5, 6 + the partial 7
    assert release("window:7", 30) == [0, 1, 2, 3, 4]  # 7 tokens round up to 2 blocks
    assert release("window:8", 28) == [0, 1, 2, 3, 4]  # no partial block: 5 and 6 kept
    assert release("sink:4+window:8", 30) == [1, 2, 3, 4]
    assert release("sink:4+window:8", 12) == []  # nothing in the middle yet
    live = [True, False, False, True, True, True, True, True]
    assert release("sink:4+window:8", 30, live) == [3, 4]  # already released: not repeated


def test_h2o_keeps_the_heaviest_middle_blocks():
    mass = np.array([9.0, 1.0, 5.0, 0.5, 5.0, 2.0, 3.0, 1.0])
    # budget 16 tokens = 4 blocks: 1 sink + 2 window + 1 heavy; middle is blocks 1..4
    assert release("h2o:budget=16+sink=4+window=8", 30, mass=mass) == [1, 2, 3]  # tie: later
    live = [True, True, False, True, True, True, True, True]
    assert release("h2o:budget=20+sink=4+window=8", 30, live, mass) == [3]  # 2 heavy: 4 and 1
    with pytest.raises(RetentionError, match="mass"):
        release("h2o:budget=16+sink=4+window=8", 30)
    with pytest.raises(RetentionError, match="live"):
        release("window:8", 30, live=[True])


@pytest.fixture(scope="module")
def lm():
    return PagedLM(tiny_llama(seed=0, **TINY), block_size=BS, backend="torch")


def test_full_stream_equals_the_plain_perplexity(lm):
    seq = torch.randint(3, 300, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    ppl, peak = stream_perplexity(lm, parse_retention("full"), seq, 8)
    assert ppl == pytest.approx(perplexity(lm, "auto", [seq], 8), rel=1e-6)
    assert peak == -(-49 // BS)  # the last token is only a target


def test_a_window_wider_than_the_text_is_exact_and_a_narrow_one_is_not(lm):
    seq = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    full, _ = stream_perplexity(lm, parse_retention("full"), seq, 8)
    wide, _ = stream_perplexity(lm, parse_retention("window:64"), seq, 8)
    narrow, peak = stream_perplexity(lm, parse_retention("sink:4+window:8"), seq, 8)
    assert wide == full and narrow != full
    assert peak == 1 + 2 + 2  # sink + window, plus the step's 8 tokens (no partial block)


def test_streamer_releases_blocks_and_accumulates_mass(lm):
    s = Streamer(lm, parse_retention("h2o:budget=16+sink=4+window=8"), 2, 64, 8)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        s.feed(torch.randint(3, 300, (2, 8), generator=gen).tolist())
    held = ~s.released[:, :10]
    assert (held.sum(1) == 4).all() and held[:, 0].all() and held[:, -2:].all()
    assert (s.mass[:, :10] > 0).all()  # every block was attended while it was held
    # per step: sum over layers, heads and query rows of probabilities that sum to 1
    assert s.mass.sum() == pytest.approx(5 * 2 * 8 * 2 * 4, rel=1e-4)


def test_needle_on_a_byte_tokenizer(lm):
    tok = ByteTokenizer()
    corpus = tok("the quick brown fox jumps over the lazy dog. " * 20).input_ids
    cases = needle_cases(tok, corpus, [120, 160], [20, 80], seed=0)
    assert [(c.length, c.depth) for c in cases] == [(120, 20), (120, 80), (160, 20), (160, 80)]
    assert all(len(c.prompt) == c.length for c in cases)
    ok = needle(lm, tok, parse_retention("window:32"), cases, 16, answer_tokens=2)
    assert len(ok) == 4 and all(isinstance(x, bool) for x in ok)


def test_eval_kv_retention_cli_on_tiny_llama(capsys):
    argv = ["--model", "tiny-llama", "--retention", "sink:4+window:28,h2o:budget=32",
            "--doc-len", "96", "--needle-contexts", "160", "--needle-depths", "50",
            "--chunk", "16", "--seed", "3", "--backend", "torch"]  # fmt: skip
    assert eval_kv_main(argv) == 0
    lines = dict(
        line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line
    )
    for p in ("full", "sink_4_window_28", "h2o_budget_32"):  # full is added first
        for m in ("ppl", "ppl_delta_pct", "needle_acc", "peak_blocks_per_seq"):
            assert f"{m}_{p}" in lines
    assert float(lines["ppl_delta_pct_full"].split()[0]) == 0
    assert lines["peak_blocks_per_seq_sink_4_window_28"] == "4 blocks"  # 1 + 2 + 1 (of 16)


@pytest.mark.parametrize(
    "spec", ["foo", "window:-3", "h2o:budget=10+window=20", "full,full", "sink:4"]
)
def test_eval_kv_refuses_bad_policies(capsys, spec):
    with pytest.raises(SystemExit) as e:
        eval_kv_main(["--model", "tiny-llama", "--retention", spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--retention" in err
