"""The Llama family beyond Llama: Mistral (with a sliding window), Qwen2 (q/k/v biases) and Qwen3
(q/k norms), tiny and seeded, served unmodified through kvcore's attention backend: greedy tokens
equal transformers' generate with chunked prefill, prefix hits and mixed lengths in one batch."""

import pytest
import torch
from kvcore.entrypoints.llm import LLM
from test_engine import SMALL, _check, _greedy, _hf_greedy, _prompts

GEOMETRY = {**SMALL, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def _family(name):
    import transformers as tf

    if name == "mistral":
        # A window shorter than the prompts, so the paged kernels must apply it.
        return tf.MistralForCausalLM(tf.MistralConfig(**GEOMETRY, sliding_window=24))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**GEOMETRY))
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**GEOMETRY, head_dim=16))


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3"])
def test_family_greedy_matches_generate(name):
    torch.manual_seed(11)
    model = _family(name).eval()
    assert model.config.model_type == name
    shared = _prompts([12], seed=21)[0]
    prompts = _prompts([30, 5, 41], seed=22, prefix=shared) + _prompts([9], seed=23)
    max_tokens = [14, 20, 6, 11]
    llm = LLM(model, block_size=4, num_blocks=128, max_num_batched_tokens=24)
    outs = llm.generate(prompts, [_greedy(m) for m in max_tokens], use_tqdm=False)
    assert llm.engine.scheduler.stats().prefix_hit_tokens > 0
    for o, p, m in zip(outs, prompts, max_tokens, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, p, m), name
    _check(llm)
