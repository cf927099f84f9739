"""The embedded SmolLM2-135M-Instruct end to end: equality with transformers' generate, chat,
stop strings, streaming. Few short prompts: the model is slow on a CPU."""

import pytest
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import load_model
from kvcore.params import SamplingParams

QUESTIONS = ["What is 2 + 2?", "Name a color.", "Write one word about the sea, then explain it."]


@pytest.fixture(scope="module")
def smol():
    model, tok = load_model("smollm2-135m", dtype="float32")  # exactness: fp32, not auto (bf16)
    return model, tok


def _chat_ids(tok, text):
    msgs = [{"role": "user", "content": text}]
    return list(
        tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    )


def _hf(model, prompt, max_tokens):
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # EOS = pad in prompts
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def _check(llm):
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_invariants()
    assert llm.engine.all_blocks_free()


def test_greedy_matches_generate_chunked_prefix_n2(smol):
    model, tok = smol
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    # Small blocks and budget: chunked prefill; the template's shared system prompt: prefix hits.
    llm = LLM(model, tokenizer=tok, num_blocks=128, block_size=8, max_num_batched_tokens=40)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=n) for n in (1, 2, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p in zip(outs, prompts, strict=True):
        ref = _hf(model, p, 8)
        assert all(c.token_ids == ref for c in o.outputs)
        assert o.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    assert len(outs[1].outputs) == 2
    assert llm.engine.scheduler.stats().prefix_hit_tokens > 0
    _check(llm)


def test_preemption_matches_generate(smol):
    model, tok = smol
    prompts = [_chat_ids(tok, q) for q in QUESTIONS[:2]]
    # 11 blocks of 8 tokens: the two ~36-token prompts are admitted (5 blocks each), then grow
    # to 6 blocks each while decoding: one of them must be preempted and recomputed.
    llm = LLM(model, tokenizer=tok, num_blocks=12, block_size=8, prefix_caching="off")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for o, p in zip(outs, prompts, strict=True):
        assert o.outputs[0].token_ids == _hf(model, p, 10)
    _check(llm)


def test_chat_stop_strings_and_streaming(smol):
    model, tok = smol
    llm = LLM(model, tokenizer=tok, num_blocks=64)
    msgs = [{"role": "user", "content": QUESTIONS[2]}]
    base = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    full = base.outputs[0].text
    assert base.prompt_token_ids == _chat_ids(tok, QUESTIONS[2])
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)
    c = cut[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == full[: full.index(stop)]
    texts = [
        o.outputs[0].text
        for o in llm.engine.stream(
            base.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12)
        )
    ]
    assert texts[-1] == full and all(full.startswith(t) for t in texts)
    _check(llm)


def test_quantized_kv_formats_keep_the_answers(smol):
    """The engine on quantized caches: int8 keeps the greedy tokens of the model-dtype cache on
    these prompts; fp8 and KIVI 2-bit still answer correctly (eval-kv measures them in full)."""
    model, tok = smol
    prompts = [_chat_ids(tok, q) for q in [*QUESTIONS, "What is the capital of France?"]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(fmt):
        llm = LLM(model, tokenizer=tok, kv_format=fmt, num_blocks=64, block_size=8)
        outs = llm.generate(prompts, params, use_tqdm=False)
        _check(llm)
        return [o.outputs[0] for o in outs]

    ref = run("auto")
    assert [c.token_ids for c in run("int8")] == [c.token_ids for c in ref]
    for fmt in ("fp8_e4m3", "kivi2"):
        assert "Paris" in run(fmt)[-1].text, fmt


def test_auto_dtype_is_what_the_forward_runs_fastest():
    """``dtype="auto"``: SmolLM2's declared bfloat16 where this CPU runs it faster than fp32 for
    the forward the engine will run (kvcore's eager code: native bf16 or the AVX2 linear), fp32
    for transformers' modules on a CPU without native bf16 (their bf16 GEMM is ~10x slower)."""
    from kvcore.models.dtype import cpu_has_native_bf16, cpu_runs_bf16

    want = torch.bfloat16 if cpu_runs_bf16(True) else torch.float32
    assert LLM("smollm2-135m", num_blocks=16).engine.model.dtype == want
    hf = LLM("smollm2-135m", num_blocks=16, model_impl="transformers")
    assert hf.engine.runner.model_impl == "transformers"
    assert hf.engine.model.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
