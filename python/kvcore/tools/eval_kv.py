"""The quality gate of quantized KV caches: a real model run on paged caches of each format.

``PagedLM`` runs an unmodified transformers model on paged caches (one list of per-layer caches
per format, plain tensors or ``QuantKVCache``) through the engine's own attention backend
(``kvcore.runner.attention``) with every token's attention reading the cache: store first
(quantize on write), then attend (dequantize on load). Sequences are prefilled in chunks, so
later tokens read earlier, already quantized blocks, exactly as decode does.

Measurements (all against the model-dtype cache "auto", same kernels, same schedule):

* ``perplexity``: NLL of real English text (``pydoc_data.topics``, shipped with Python);
* ``agreement``: greedy tokens of the "auto" run fed back (teacher forcing) to each format,
  one token per step like decode; the share of steps whose argmax equals the reference token;
* ``layer_errors``: per layer ``||o_fmt - o_ref|| / ||o_ref||`` of the attention output when that
  layer's reference K/V are stored in the format (one pass measures every format: probes);
* ``needle``: a pass key hidden at half depth in 1K-4K tokens of text, asked for at the end.

Block ids: sequence ``r`` owns blocks ``1 + r * max_blocks ...`` (the scheduler is not needed).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import kvcore_kernels as kk
import numpy as np
import torch
from kvcore_kernels.quant import QuantKVCache, allocate_kv_caches

from kvcore.errors import InvalidArgumentError
from kvcore.models.sizes import kv_geometry
from kvcore.runner.attention import CTX_KWARG, AttentionContext, LayerProbes, use_kvcore_attention


class PagedLM:
    """A transformers causal LM run step by step on paged KV caches of any format."""

    def __init__(self, model: Any, *, block_size: int = 16, backend: str = "auto", **cache_kw):
        use_kvcore_attention(model)
        self.model, self.block_size, self.backend, self.cache_kw = (
            model,
            block_size,
            backend,
            cache_kw,
        )
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(model.config)
        self.device = next(model.parameters()).device

    def caches(self, formats, num_seqs: int, max_len: int, step_tokens: int) -> list[Any]:
        """Fresh caches for ``num_seqs`` sequences of up to ``max_len`` tokens, fed at most
        ``step_tokens`` tokens per sequence per step (this sizes KIVI's residual pool: every
        block a step writes, plus the window, per sequence)."""
        bs = self.block_size
        per_seq = -(-max_len // bs)
        window = self.cache_kw.get("kivi_window", 0)
        slots = num_seqs * (-(-step_tokens // bs) + 1 + window)
        return allocate_kv_caches(
            formats, self.num_layers, 1 + num_seqs * per_seq, bs, self.num_kv_heads,
            self.head_dim, self.model.dtype, self.device, num_residual_blocks=slots,
            **self.cache_kw,
        )  # fmt: skip

    @torch.inference_mode()
    def step(self, caches, starts, tokens, *, last_only=False, probes=None, ctx_out=None,
             released=None, block_mass=None):  # fmt: skip
        """Run one step: ``tokens[r]`` are appended to sequence ``r`` at position ``starts[r]``.

        Returns float logits: every token's ``[sum(len), V]``, or ``[num_seqs, V]`` with
        ``last_only``. ``probes``: {format: caches} measured per layer (``ctx_out`` gets the
        step's ``AttentionContext``: its ``probes`` hold the sums). ``released`` (bool
        ``[num_seqs, blocks per sequence]``): logical blocks a retention policy dropped, null
        entries in the block table; ``block_mass`` (fp32, same shape) gets every layer's
        attention mass added.
        """
        bs, num_seqs = self.block_size, len(tokens)
        num_blocks = (caches[0].num_blocks if isinstance(caches[0], QuantKVCache)
                      else caches[0].shape[0])  # fmt: skip
        per_seq = (num_blocks - 1) // num_seqs
        table = 1 + np.arange(num_seqs)[:, None] * per_seq + np.arange(per_seq)[None, :]
        slot_table = table
        if released is not None:
            table = np.where(released[:, :per_seq], 0, table)
        lens = np.array([len(t) for t in tokens])
        pos = np.concatenate([s + np.arange(n) for s, n in zip(starts, lens, strict=True)])
        seq = np.repeat(np.arange(num_seqs), lens)
        slots = slot_table[seq, pos // bs] * bs + pos % bs
        qsl = np.concatenate([[0], np.cumsum(lens)])
        dev = self.device
        meta = kk.plan_attention(qsl, np.asarray(starts) + lens, table, bs, device=dev)
        ctx = AttentionContext(
            caches, torch.from_numpy(slots).to(dev), meta, self.backend, block_mass=block_mass,
            probes=None if probes is None else LayerProbes.of(probes, self.num_layers),
        )  # fmt: skip
        keep = torch.from_numpy(qsl[1:] - 1).to(dev) if last_only else 0
        flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens])
        ids = torch.from_numpy(flat).to(dev)[None]
        out = self.model(
            input_ids=ids, position_ids=torch.from_numpy(pos).to(dev)[None], use_cache=False,
            logits_to_keep=keep, **{CTX_KWARG: ctx},
        )  # fmt: skip
        if ctx_out is not None:
            ctx_out.append(ctx)
        return out.logits[0].float()


def perplexity(lm: PagedLM, formats, seqs: list[list[int]], chunk: int) -> float:
    """Perplexity of equal-length ``seqs`` (batched), prefilled ``chunk`` tokens per step."""
    if not seqs or len(seqs[0]) < 2 or not (isinstance(chunk, int) and chunk >= 1):
        raise InvalidArgumentError("perplexity: needs sequences of >= 2 tokens and a chunk >= 1")
    n = len(seqs[0])
    if any(len(s) != n for s in seqs):
        raise InvalidArgumentError("perplexity: sequences must have equal lengths")
    names = [formats] if isinstance(formats, str) else list(formats)
    if n - 1 <= chunk and any(str(f).startswith("kivi") for f in names):
        warnings.warn(
            f"perplexity: {n - 1} tokens fed in one step of {chunk}: KIVI reads no quantized KV "
            "(it keeps the step's blocks in full precision), so its change reads 0; use a "
            "chunk below the text length",
            stacklevel=2,
        )
    caches = lm.caches(formats, len(seqs), n, chunk)
    nll, count = 0.0, 0
    for start in range(0, n - 1, chunk):
        parts = [s[start : min(start + chunk, n - 1)] for s in seqs]  # the last token is a target
        logits = lm.step(caches, [start] * len(seqs), parts)
        targets = torch.tensor([t for s in seqs for t in s[start + 1 : start + 1 + len(parts[0])]])
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return float(np.exp(nll / count))


def greedy_reference(lm: PagedLM, prompts: list[list[int]], gen: int) -> list[list[int]]:
    """``gen`` greedy tokens per prompt on the model-dtype cache, all prompts batched."""
    longest = max(map(len, prompts))
    caches = lm.caches("auto", len(prompts), longest + gen, longest)
    logits = lm.step(caches, [0] * len(prompts), prompts, last_only=True)
    out = [[int(t)] for t in logits.argmax(-1)]
    for i in range(gen - 1):
        starts = [len(p) + i for p in prompts]
        logits = lm.step(caches, starts, [[o[-1]] for o in out], last_only=True)
        for o, t in zip(out, logits.argmax(-1).tolist(), strict=True):
            o.append(int(t))
    return out


def agreement(lm: PagedLM, formats, prompts, reference: list[list[int]]) -> float:
    """Share of reference greedy tokens a format's cache predicts too (teacher forcing)."""
    gen = len(reference[0])
    longest = max(map(len, prompts))
    caches = lm.caches(formats, len(prompts), longest + gen, longest)
    logits = lm.step(caches, [0] * len(prompts), prompts, last_only=True)
    hits = int((logits.argmax(-1).cpu() == torch.tensor([r[0] for r in reference])).sum())
    for i in range(gen - 1):
        starts = [len(p) + i for p in prompts]
        logits = lm.step(caches, starts, [[r[i]] for r in reference], last_only=True)
        want = torch.tensor([r[i + 1] for r in reference])
        hits += int((logits.argmax(-1).cpu() == want).sum())
    return hits / (gen * len(prompts))


def layer_errors(lm: PagedLM, formats: dict[str, Any], seq: list[int], chunk: int) -> dict:
    """Per-layer relative attention-output error of each format (one reference pass)."""
    ref = lm.caches("auto", 1, len(seq), chunk)
    probes = {name: lm.caches(f, 1, len(seq), chunk) for name, f in formats.items()}
    err = {name: np.zeros(lm.num_layers) for name in formats}
    sq_ref = np.zeros(lm.num_layers)
    for start in range(0, len(seq), chunk):
        got: list[AttentionContext] = []
        lm.step(ref, [start], [seq[start : start + chunk]], last_only=True, probes=probes,
                ctx_out=got)  # fmt: skip
        sums = got[0].probes
        assert sums is not None  # probes given: the context carries their sums
        sq_ref += sums.sq_ref
        for name in formats:
            err[name] += sums.sq_err[name]
    return {name: np.sqrt(e / np.maximum(sq_ref, 1e-30)) for name, e in err.items()}


def needle_prompts(tokenizer, corpus_ids: list[int], lengths, seed: int):
    """(prompt ids, pass key) per length: the key at half depth in corpus text."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        key = rng.randint(10000, 99999)
        needle = tokenizer(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
        ask = tokenizer("\nWhat is the pass key? The pass key is")
        body = n - len(needle.input_ids) - len(ask.input_ids)
        if body < 16 or body > len(corpus_ids):
            raise InvalidArgumentError(f"needle length {n} does not fit the corpus")
        start = rng.randint(0, len(corpus_ids) - body)
        text = corpus_ids[start : start + body]
        out.append((text[: body // 2] + needle.input_ids + text[body // 2 :] + ask.input_ids, key))
    return out


def needle(lm: PagedLM, tokenizer, formats, cases, chunk: int, answer_tokens: int = 8):
    """Whether each case's pass key comes back in the greedy answer (list of bools)."""
    prompts = [p for p, _ in cases]
    longest = max(map(len, prompts))
    caches = lm.caches(formats, len(prompts), longest + answer_tokens, chunk)
    done = [0] * len(prompts)
    answers: list[list[int]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        live = [r for r, p in enumerate(prompts) if done[r] < len(p)]
        parts = [prompts[r][done[r] : done[r] + chunk] for r in live]
        logits = _partial_step(lm, caches, prompts, live, done, parts)
        for r, t in zip(live, logits.argmax(-1).tolist(), strict=True):
            done[r] += len(parts[live.index(r)])
            if done[r] == len(prompts[r]):
                answers[r].append(int(t))
    for i in range(answer_tokens - 1):
        starts = [len(p) + i for p in prompts]
        logits = lm.step(caches, starts, [[a[-1]] for a in answers], last_only=True)
        for a, t in zip(answers, logits.argmax(-1).tolist(), strict=True):
            a.append(int(t))
    texts = [tokenizer.decode(a).replace(" ", "") for a in answers]
    return [str(key) in t for t, (_, key) in zip(texts, cases, strict=True)]


def _partial_step(lm, caches, prompts, live, done, parts):
    """A step in which only ``live`` sequences advance (the others send no token)."""
    tokens = [parts[live.index(r)] if r in live else [] for r in range(len(prompts))]
    starts = list(done)
    return lm.step(caches, starts, tokens, last_only=True)[live]
