"""Retention in the engine: exact sliding-window release on a tiny Mistral (every layer windowed)
gives the same greedy tokens as keeping every block and as transformers' generate, through chunked
prefill, prefix hits, parallel samples and preemption, while holding fewer blocks; lossy policies
are refused before anything runs where the kernels or formats cannot run them."""

import numpy as np
import pytest
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.errors import InvalidArgumentError
from kvcore.retention.release import fill_released, kernels_take_null_entries
from kvcore.retention.spec import RetentionError
from test_engine import SMALL, _check, _greedy, _hf_greedy, _prompts

GEOMETRY = {**SMALL, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
WINDOW = 20  # tokens: 5 blocks of 4, shorter than the prompts


@pytest.fixture(scope="module")
def mistral():
    import transformers as tf

    torch.manual_seed(5)
    return tf.MistralForCausalLM(tf.MistralConfig(**GEOMETRY, sliding_window=WINDOW)).eval()


@pytest.fixture(scope="module")
def llama():
    import transformers as tf

    torch.manual_seed(6)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**GEOMETRY)).eval()


def _run(model, prompts, params, **kw):
    kw.setdefault("num_blocks", 256)
    llm = LLM(model, block_size=4, max_num_batched_tokens=24, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check(llm)
    return llm, outs


def test_window_release_is_exact_and_holds_fewer_blocks(mistral):
    shared = _prompts([16], seed=1)[0]
    prompts = _prompts([30, 6, 44], seed=2, prefix=shared) + _prompts([9], seed=3)
    params = [_greedy(m) for m in (40, 25, 12, 50)]
    on, outs_on = _run(mistral, prompts, params)
    off, outs_off = _run(mistral, prompts, params, sliding_window_release=False)
    assert on.engine.sliding_window == WINDOW and off.engine.sliding_window == 0
    for a, b, p, sp in zip(outs_on, outs_off, prompts, params, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].token_ids == _hf_greedy(mistral, p, sp.max_tokens)
    s_on, s_off = on.engine.scheduler.stats(), off.engine.scheduler.stats()
    assert s_on.prefix_hit_tokens > 0
    assert s_on.num_released_blocks > 0 and s_off.num_released_blocks == 0
    # A decode at position c reads the blocks of c-19..c: at most 6; a prefill chunk of 24
    # tokens adds its own. Without release a sequence holds all of its KV (the last sampled
    # token has none).
    full = max(-(-(len(p) + sp.max_tokens - 1) // 4) for p, sp in zip(prompts, params, strict=True))
    assert s_on.peak_seq_blocks <= 6 + 24 // 4 + 1 < s_off.peak_seq_blocks
    assert max(o.peak_kv_blocks for o in outs_on) == s_on.peak_seq_blocks
    assert max(o.peak_kv_blocks for o in outs_off) == s_off.peak_seq_blocks == full


def test_window_release_with_samples_and_preemption(mistral):
    prompts = _prompts([26, 33, 18], seed=7)
    params = [_greedy(40, n=2), _greedy(36), _greedy(44)]
    # 40 blocks: without release the three sequences cannot all grow at once.
    small, outs = _run(mistral, prompts, params, num_blocks=40)
    big, ref = _run(mistral, prompts, params, sliding_window_release=False)
    for a, b in zip(outs, ref, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert small.engine.scheduler.stats().num_released_blocks > 0
    tight, again = _run(
        mistral, prompts, params, num_blocks=40, sliding_window_release=False
    )  # the same budget without release preempts (recompute) and still agrees
    assert tight.engine.scheduler.stats().num_preemptions > 0
    assert small.engine.scheduler.stats().num_preemptions == 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]


def test_full_attention_models_release_nothing(llama):
    llm, outs = _run(llama, _prompts([30], seed=9), [_greedy(20)])
    assert llm.engine.sliding_window == 0
    assert llm.engine.scheduler.stats().num_released_blocks == 0
    assert outs[0].peak_kv_blocks == 13  # 30 + 20 - 1 tokens of KV in blocks of 4


def test_hybrid_configs_keep_every_block():
    import transformers as tf

    cfg = tf.Qwen2Config(**GEOMETRY, sliding_window=8, use_sliding_window=True, max_window_layers=1)
    model = tf.Qwen2ForCausalLM(cfg).eval()
    llm = LLM(model, block_size=4, num_blocks=64)
    assert llm.engine.sliding_window == 0  # layer 0 is global: groups are needed (not built)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("h2o:budget=8+sink=4+window=8", "smaller than sinks plus window"),
        ("window:-3", "non-negative"),
        ("sink:4+window:0", "at least 1"),
        ("nope", "unknown policy"),
    ],
)
def test_bad_or_unsupported_policies_refused_before_running(llama, spec, match):
    with pytest.raises(RetentionError, match=match):
        LLM(llama, block_size=4, num_blocks=64, retention=spec)
    llm = LLM(llama, block_size=4, num_blocks=64)
    with pytest.raises(InvalidArgumentError, match=match):
        llm.generate([[5, 6, 7]], _greedy(3), use_tqdm=False, retention=spec)
    assert not llm.engine.has_unfinished_requests()
    _check(llm)


def test_lossy_policies_on_quantized_formats_refused(llama):
    with pytest.raises(RetentionError, match="quantized"):
        LLM(llama, block_size=4, num_blocks=64, kv_format="int8", retention="sink:4+window:16")


def test_sink_window_policy_runs_or_is_refused(llama):
    prompts = _prompts([40], seed=12)
    if not kernels_take_null_entries():
        with pytest.raises(RetentionError, match="null"):
            LLM(llama, block_size=4, num_blocks=64, retention="sink:4+window:16")
        return
    llm, outs = _run(llama, prompts, [_greedy(40)], retention="sink:4+window:16")
    stats = llm.engine.scheduler.stats()
    assert stats.num_released_blocks > 0
    # 1 sink block + 4 window blocks + the block being written + a prefill chunk's blocks.
    assert outs[0].peak_kv_blocks <= 1 + 4 + 1 + 24 // 4
    assert len(outs[0].outputs[0].token_ids) == 40
    # Thinned KV is never published: a second run of the same prompt hits at most what was
    # cached before the first drop.
    again = llm.generate(prompts, [_greedy(1)], use_tqdm=False)
    assert again[0].num_cached_tokens <= 40


def test_fill_released_fills_only_used_null_entries():
    table = np.array([[0, 0, 7, 9, 0], [3, 0, 0, 0, 0]])
    out = fill_released(table, np.array([14, 3]), 4)
    assert out.tolist() == [[9, 9, 7, 9, 0], [3, 0, 0, 0, 0]]
    assert fill_released(out, np.array([14, 3]), 4) is out


def test_window_release_with_host_tier_and_swap_preemption(mistral):
    # Released tables are recomputed, never swapped; evicted cached blocks still go to L2.
    shared = _prompts([12], seed=30)[0]
    prompts = _prompts([28, 20, 34], seed=31, prefix=shared)
    params = [_greedy(m) for m in (30, 36, 26)]
    kw = dict(num_blocks=36, host_kv_bytes=1 << 22, preemption="swap")
    tiered, outs = _run(mistral, prompts, params, **kw)
    _, ref = _run(mistral, prompts, params, sliding_window_release=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert tiered.engine.scheduler.stats().num_released_blocks > 0
    again = tiered.generate(prompts[:1], params[:1], use_tqdm=False)
    assert again[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    _check(tiered)


def test_kv_groups_of_hybrid_layouts():
    from kvcore.retention.release import kv_groups

    assert kv_groups((20, 20, 20)) is None and kv_groups((None, None)) is None
    gemma = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    g = kv_groups(gemma)
    assert (g.size, g.windows) == (3, (0, 512, 512, 512, 512, 512))
    assert [g.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert g.layer_slot[5:18:6] == (0, 1, 2) and g.layer_group[0] == 1


def test_hybrid_groups_are_exact_and_hold_fewer_blocks():
    import transformers as tf

    torch.manual_seed(8)
    cfg = tf.Qwen2Config(**GEOMETRY, sliding_window=12, use_sliding_window=True)
    cfg.num_hidden_layers, cfg.max_window_layers = 4, 2  # layers 0, 1 global; 2, 3 local
    cfg.layer_types = ["full_attention"] * 2 + ["sliding_attention"] * 2
    model = tf.Qwen2ForCausalLM(cfg).eval()
    prompts = _prompts([30, 12, 41], seed=40)
    params = [_greedy(m) for m in (24, 30, 16)]
    grouped, outs = _run(model, prompts, params, prefix_caching="off")
    plain, ref = _run(model, prompts, params)  # prefix caching on: no groups, every block kept
    assert grouped.engine.kv_groups.windows == (0, 12) and plain.engine.kv_groups is None
    for o, r, p, sp in zip(outs, ref, prompts, params, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert o.outputs[0].token_ids == _hf_greedy(model, p, sp.max_tokens)
    # A block holds 2 layers with groups, 4 without: the global group keeps all of a
    # sequence's blocks, the local one its window (4 blocks) plus a prefill chunk.
    full = max(-(-(len(p) + sp.max_tokens - 1) // 4) for p, sp in zip(prompts, params, strict=True))
    assert plain.engine.scheduler.stats().peak_seq_blocks == full
    assert grouped.engine.scheduler.stats().peak_seq_blocks <= full + 4 + 24 // 4 + 1 < 2 * full
    assert grouped.engine.scheduler.stats().num_released_blocks > 0


def test_scheduler_takes_drops_through_update():
    from kvcore import _kvcore

    s = _kvcore.Scheduler(64, block_size=4, max_num_batched_tokens=8, prefix_mode="off")
    s.add_request(1, np.arange(1, 17), 4, ignore_eos=True)
    p = s.schedule()
    s.update(p.step_id, np.zeros(len(p.logits_indices), np.int64))
    p = s.schedule()
    sampled = np.zeros(len(p.logits_indices), np.int64)
    for bad in ([0, 2], [0], [3, 0], [0, -1]):  # written this step, odd, no row, negative
        with pytest.raises(InvalidArgumentError):
            s.update(p.step_id, sampled, drop_blocks=np.asarray(bad, np.int64))
    s.update(p.step_id, sampled, drop_blocks=np.asarray([0, 1], np.int64))
    assert s.stats().num_released_blocks == 1
    p = s.schedule()
    assert p.block_table[0, 1] == 0 and p.group_block_table.shape == (0, 1, p.block_table.shape[1])
    s.update(p.step_id, np.zeros(len(p.logits_indices), np.int64))
    while s.has_unfinished():
        p = s.schedule()
        s.update(p.step_id, np.zeros(len(p.logits_indices), np.int64))
    s.check_invariants()
    assert s.stats().num_free_blocks == 63


def test_has_released_looks_only_inside_used_blocks():
    from kvcore.retention.release import has_released

    table = np.array([[3, 4, 0, 0], [5, 0, 6, 0]], np.int32)  # trailing zeros: padding
    assert not has_released(table[:1], np.array([8]), 4)
    assert has_released(table, np.array([8, 12]), 4)  # row 1: block 1 released
    assert not has_released(table, np.array([8, 4]), 4)
