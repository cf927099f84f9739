"""transformers' greedy ``generate`` as the reference the engine's tokens are compared with."""

import torch


def hf_greedy(model, prompt, max_tokens, attn="sdpa", **kwargs):
    """The ``max_tokens`` greedy tokens after ``prompt`` (no EOS stop), through ``attn``
    (``"eager"`` where the model needs its own masks, e.g. Gemma 2's soft-capping);
    ``kwargs`` go to ``generate`` (``pad_token_id=0`` for configs without one)."""
    model.set_attn_implementation(attn)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=None,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()
