"""The quality gate of retention policies: a real model whose KV a policy thins as text streams in.

``Streamer`` feeds equal-length sequences to ``eval_kv.PagedLM`` ``chunk`` tokens per step; after
every step the policy (``retention.blocks_to_release``) releases logical blocks, which become
null block-table entries that the next steps' attention skips (block-granular, exactly as the
engine does). H2O ranks blocks by the attention mass the kernels return (``block_mass``, summed
over layers, heads and query rows, accumulated over steps). Positions stay the original ones
(RoPE applied at store time): see docs/retention.md for why.

Measurements per policy (``full`` is the reference):

* ``perplexity``: NLL of ``doc_len`` tokens of real English text (``pydoc_data.topics``, shipped
  with Python under the PSF licence), the seed choosing the offset;
* ``needle``: a pass key hidden at each depth of each context length, asked for at the end;
* ``peak blocks``: the most blocks a sequence held during any step (kept + the step's own).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.errors import InvalidArgumentError
from kvcore.eval_kv import PagedLM
from kvcore.retention import RetentionPolicy, blocks_to_release


class Streamer:
    """Equal-length sequences fed in steps, thinned by ``policy`` after every step."""

    def __init__(self, lm: PagedLM, policy: RetentionPolicy, num_seqs: int, max_len: int,
                 chunk: int):  # fmt: skip
        self.lm, self.policy, self.chunk = lm, policy, chunk
        self.caches = lm.caches("auto", num_seqs, max_len, chunk)
        per_seq = (self.caches[0].shape[0] - 1) // num_seqs
        self.released = np.zeros((num_seqs, per_seq), dtype=bool)
        self.mass = np.zeros((num_seqs, per_seq))
        self.num_tokens = 0
        self.peak_blocks = 0

    def feed(self, tokens: list[list[int]], *, last_only: bool = False) -> torch.Tensor:
        """One step: every sequence gets its ``tokens[r]`` (equal lengths); returns logits."""
        n = len(tokens[0])
        end = self.num_tokens + n
        bs = self.lm.block_size
        nblk = -(-end // bs)
        held = (~self.released[:, :nblk]).sum(1)
        self.peak_blocks = max(self.peak_blocks, int(held.max()))
        mass = None
        if self.policy.kind == "h2o":
            mass = torch.zeros(self.released.shape, dtype=torch.float32, device=self.lm.device)
        starts = [self.num_tokens] * len(tokens)
        logits = self.lm.step(self.caches, starts, tokens, last_only=last_only,
                              released=self.released, block_mass=mass)  # fmt: skip
        self.num_tokens = end
        if mass is not None:
            self.mass += mass.cpu().double().numpy()
        for r in range(len(tokens)):
            live = ~self.released[r, :nblk]
            drop = blocks_to_release(self.policy, end, bs, live, self.mass[r, :nblk])
            self.released[r, drop] = True
        return logits


def stream_perplexity(lm: PagedLM, policy: RetentionPolicy, seq: list[int], chunk: int):
    """(perplexity, peak blocks) of ``seq`` streamed ``chunk`` tokens per step under ``policy``."""
    if len(seq) < 2:
        raise InvalidArgumentError("perplexity needs at least 2 tokens")
    s = Streamer(lm, policy, 1, len(seq), chunk)
    nll, count = 0.0, 0
    for start in range(0, len(seq) - 1, chunk):
        part = seq[start : min(start + chunk, len(seq) - 1)]  # the last token is only a target
        logits = s.feed([part])
        targets = torch.tensor(seq[start + 1 : start + 1 + len(part)], device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(part)
    return float(np.exp(nll / count)), s.peak_blocks


@dataclass(frozen=True)
class NeedleCase:
    prompt: list[int]
    key: int
    length: int
    depth: int  # percent of the haystack before the needle


def needle_cases(tokenizer, corpus: list[int], lengths, depths, seed: int) -> list[NeedleCase]:
    """A pass key at ``depth`` % of ``length`` tokens of corpus text, per (length, depth)."""
    rng = random.Random(seed)
    ask = tokenizer("\nWhat is the pass key? The pass key is").input_ids
    out = []
    for n in lengths:
        for d in depths:
            key = rng.randint(10000, 99999)
            needle = tokenizer(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
            body = n - len(needle.input_ids) - len(ask)
            if body < 16 or body > len(corpus):
                raise InvalidArgumentError(f"needle context {n} does not fit the corpus")
            start = rng.randint(0, len(corpus) - body)
            text, cut = corpus[start : start + body], body * d // 100
            prompt = text[:cut] + needle.input_ids + text[cut:] + ask
            out.append(NeedleCase(prompt, key, n, d))
    return out


def needle(lm: PagedLM, tokenizer, policy, cases: list[NeedleCase], chunk: int,
           answer_tokens: int = 8) -> list[bool]:  # fmt: skip
    """Whether each case's key comes back in the greedy answer; cases of equal prompt length
    run as one batch, streamed ``chunk`` tokens per step, then decoded one token per step."""
    result: dict[int, bool] = {}
    for plen in sorted({len(c.prompt) for c in cases}):
        idx = [i for i, c in enumerate(cases) if len(c.prompt) == plen]
        s = Streamer(lm, policy, len(idx), plen + answer_tokens, chunk)
        for start in range(0, plen, chunk):
            logits = s.feed([cases[i].prompt[start : start + chunk] for i in idx], last_only=True)
        answers = [[int(t)] for t in logits.argmax(-1).tolist()]
        for _ in range(answer_tokens - 1):
            logits = s.feed([[a[-1]] for a in answers], last_only=True)
            for a, t in zip(answers, logits.argmax(-1).tolist(), strict=True):
                a.append(int(t))
        for i, a in zip(idx, answers, strict=True):
            result[i] = str(cases[i].key) in tokenizer.decode(a).replace(" ", "")
    return [result[i] for i in range(len(cases))]


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258: lets a model without a tokenizer (the seeded random
    ``tiny-llama`` of the tests) run the gate; its numbers mean nothing about quality."""

    def __call__(self, text: str):
        return _Encoded([3 + b for b in text.encode()])

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")


@dataclass(frozen=True)
class _Encoded:
    input_ids: list[int]
