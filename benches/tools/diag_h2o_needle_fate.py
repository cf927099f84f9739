"""Diagnostic (docs/retention.md, "Why H2O misses the needle"): when does H2O drop the needle's
blocks? Streams the passkey cases of one context under H2O with budget 20% of the context, 4 sink
tokens and a recent window of ``share`` of the budget, ranking middle blocks by accumulated mass
(``sum``, H2O's rule) or by mass per query row that could see the block (``mean``), and prints
each needle block's (block, tokens when dropped) and the greedy answer.

    python benches/tools/diag_h2o_needle_fate.py 2048 0 sum 0.5
"""

import sys

import numpy as np
import torch
from kvcore.models.loader import load_model
from kvcore.retention.spec import blocks_to_release, parse_retention
from kvcore.tools import eval_retention as er
from kvcore.tools.eval_kv import PagedLM

BS = 16


class Traced(er.Streamer):
    """A Streamer that logs when watched blocks are dropped, with a choice of ranking."""

    def __init__(self, *a, rule: str, watch: list[set[int]]):
        super().__init__(*a)
        self.rule, self.watch = rule, watch
        self.log: list[list[tuple[int, int]]] = [[] for _ in watch]
        self.seen = np.zeros_like(self.mass)

    def feed(self, tokens, *, last_only=False):
        n, s0 = len(tokens[0]), self.num_tokens
        end, nblk = s0 + n, -(-(s0 + n) // BS)
        cnt = np.clip(end - np.maximum(s0, np.arange(self.seen.shape[1]) * BS), 0, n)
        mass = torch.zeros(self.released.shape, dtype=torch.float32)
        logits = self.lm.step(self.caches, [s0] * len(tokens), tokens, last_only=last_only,
                              released=self.released, block_mass=mass)  # fmt: skip
        self.num_tokens = end
        self.mass += mass.double().numpy()
        self.seen += np.where(self.released, 0, cnt[None, :])
        for r in range(len(tokens)):
            score = self.mass[r, :nblk]
            if self.rule == "mean":
                score = score / np.maximum(self.seen[r, :nblk], 1)
            drop = blocks_to_release(self.policy, end, BS, ~self.released[r, :nblk], score)
            self.log[r] += [(int(b), end) for b in drop if b in self.watch[r]]
            self.released[r, drop] = True
        return logits


def main() -> None:
    ctx, seed, rule, share = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m", dtype=torch.bfloat16)
    lm = PagedLM(model, block_size=BS, backend="torch")
    cases = er.needle_cases(tok, [], [ctx], [10, 30, 50, 70, 90], seed)
    budget = ctx // 5
    pol = parse_retention(f"h2o:budget={budget}+sink=4+window={int(budget * share)}")
    watch = []
    for c in cases:
        kt = tok(f"\nThe pass key is {c.key}.").input_ids[1:]
        p = next(i for i in range(len(c.prompt)) if c.prompt[i : i + len(kt)] == kt)
        watch.append({(p + j) // BS for j in range(len(kt) + 12)})
    plen = len(cases[0].prompt)
    s = Traced(lm, pol, len(cases), plen + 8, 128, rule=rule, watch=watch)
    for st in range(0, plen, 128):
        logits = s.feed([c.prompt[st : st + 128] for c in cases], last_only=True)
    ans = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(7):
        logits = s.feed([[a[-1]] for a in ans], last_only=True)
        for a, t in zip(ans, logits.argmax(-1).tolist(), strict=True):
            a.append(int(t))
    for r, c in enumerate(cases):
        text = tok.decode(ans[r])
        ok = er.key_found(c.key, text)
        print(f"{rule} w{share} ctx {ctx} s{seed} d{c.depth} blocks {sorted(watch[r])} "
              f"dropped(block,at) {s.log[r]} answer {text!r} ok {ok}")  # fmt: skip


if __name__ == "__main__":
    main()
