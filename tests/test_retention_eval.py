"""Retention policies on a real paged run: block selection, streaming with released blocks,
the H2O mass, and ``kvcore eval-kv --retention`` on the tiny random Llama."""

import numpy as np
import pytest
import torch
from kvcore.entrypoints.cli.plan import eval_kv_main
from kvcore.errors import InvalidArgumentError
from kvcore.models.loader import tiny_llama
from kvcore.retention.spec import RetentionError, blocks_to_release, parse_retention
from kvcore.tools.eval_kv import PagedLM, perplexity
from kvcore.tools.eval_retention import (
    FILLER,
    HEADER,
    ByteTokenizer,
    Streamer,
    check_reindex,
    key_found,
    needle,
    needle_cases,
    stream_perplexity,
)

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
    cases = needle_cases(tok, corpus, [120, 160], [20, 80], seed=0, fmt="prose")
    assert [(c.length, c.depth) for c in cases] == [(120, 20), (120, 80), (160, 20), (160, 80)]
    assert all(len(c.prompt) == c.length for c in cases)
    ok = needle(lm, tok, parse_retention("window:32"), cases, 16, answer_tokens=2)
    assert len(ok) == 4 and all(isinstance(x, bool) for x in ok)


def test_eval_kv_retention_cli_on_tiny_llama(capsys):
    argv = ["--model", "tiny-llama", "--retention", "sink:4+window:28,h2o:budget=32",
            "--doc-len", "96", "--needle-contexts", "320", "--needle-depths", "50",
            "--chunk", "16", "--seed", "3", "--backend", "torch",
            "--positions", "reindexed"]  # fmt: skip
    assert eval_kv_main(argv) == 0
    out = capsys.readouterr().out
    assert "positions: reindexed" in out
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    for p in ("full", "sink_4_window_28", "h2o_budget_32"):  # full is added first
        for m in ("ppl", "ppl_delta_pct", "needle_acc", "peak_blocks_per_seq"):
            assert f"{m}_{p}" in lines
    assert float(lines["ppl_delta_pct_full"].split()[0]) == 0
    assert lines["peak_blocks_per_seq_sink_4_window_28"] == "4 blocks"  # 1 + 2 + 1 (of 16)


def test_passkey_cases_put_the_needle_at_a_sentence_end_near_its_depth():
    tok = ByteTokenizer()
    cases = needle_cases(tok, [], [600, 900], [10, 50, 90], seed=4)
    assert [(c.length, c.depth) for c in cases] == [
        (n, d) for n in (600, 900) for d in (10, 50, 90)
    ]
    texts = [tok.decode(c.prompt) for c in cases]
    for c, t in zip(cases, texts, strict=True):
        assert len(c.prompt) == c.length and 10000 <= c.key <= 99999
        assert t.startswith("There is a pass key") and t.endswith("\nThe pass key is")
        before, found, after = t.partition(f"\nThe pass key is {c.key}. Remember it.")
        assert found and before.endswith(".")  # a whole filler sentence before the needle
        needle_len = len(f"\nThe pass key is {c.key}. Remember it. {c.key} is the pass key.\n")
        body = c.length - len(HEADER) - needle_len - len("\nThe pass key is")
        assert abs(len(before) - len(HEADER) - c.depth * body // 100) < 32  # the nearest end
    again = needle_cases(tok, [], [600, 900], [10, 50, 90], seed=4)
    other = needle_cases(tok, [], [600, 900], [10, 50, 90], seed=5)
    assert [c.prompt for c in again] == [c.prompt for c in cases]
    assert [c.key for c in other] != [c.key for c in cases]
    starts = {t[90:130] for t in map(tok.decode, (c.prompt for c in cases + other))}
    assert len(starts) > 1 and all(any(s in t for s in FILLER) for t in texts)
    with pytest.raises(InvalidArgumentError, match="format"):
        needle_cases(tok, [], [600], [50], seed=0, fmt="chat")


def test_the_scorer_wants_the_first_number_to_be_the_key():
    assert key_found(60494, " 60494. Remember")
    assert key_found(60494, " 6 0 4 9 4 is it")  # digit tokens with spaces
    assert key_found(60494, " the key: 60494.")
    assert not key_found(60494, " 60495. Remember")  # one digit off
    assert not key_found(60494, " 604941")
    assert not key_found(60494, " 1. 60494")  # the first number is not the key
    assert not key_found(60494, " the pass key.")


def test_reindexed_positions_rotate_kept_keys_by_the_released_span(lm):
    gen = torch.Generator().manual_seed(6)
    seq = torch.randint(3, 300, (40,), generator=gen).tolist()
    s = Streamer(lm, parse_retention("sink:4+window:8"), 1, 48, 8, reindex=True)
    for start in range(0, 40, 8):
        s.feed([seq[start : start + 8]])
    assert s.released[0, :10].tolist() == [False] + [True] * 7 + [False] * 2
    assert s.shift[0, :10].tolist() == [28] + [0] * 9  # 7 released blocks of 4 after block 0
    # the sink's keys depend on its own 4 tokens only: computed afresh at positions 28..31
    ref = lm.caches("auto", 1, 48, 8)
    lm.step(ref, [28], [seq[:4]], released=np.arange(12)[None, :] < 7)  # alone, at 28..31
    for got, want in zip(s.caches, ref, strict=True):
        torch.testing.assert_close(got[1, 0], want[1 + 7, 0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1, 1], want[1 + 7, 1])  # values never move


def test_reindexing_refuses_a_model_without_one_plain_rope():
    with pytest.raises(InvalidArgumentError, match="RoPE"):
        check_reindex(torch.nn.Linear(2, 2))


def test_reindexing_changes_nothing_without_a_gap_and_something_with_one(lm):
    seq = torch.randint(3, 300, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    for spec, same in (("window:8", True), ("full", True), ("sink:4+window:8", False)):
        orig, _ = stream_perplexity(lm, parse_retention(spec), seq, 8)
        moved, _ = stream_perplexity(lm, parse_retention(spec), seq, 8, reindex=True)
        assert (orig == moved) == same, spec


@pytest.mark.parametrize(
    "spec", ["foo", "window:-3", "h2o:budget=10+window=20", "full,full", "sink:4"]
)
def test_eval_kv_refuses_bad_policies(capsys, spec):
    with pytest.raises(SystemExit) as e:
        eval_kv_main(["--model", "tiny-llama", "--retention", spec])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--retention" in err
