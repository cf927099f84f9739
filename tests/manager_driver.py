"""Drives kvcore.KvCacheManager and the pure-Python reference in lockstep and compares them."""

from __future__ import annotations

import kvcore
import numpy as np
from reference_manager import ReferenceManager

I64 = np.int64


def flat(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat uint32 tokens and int64 offsets of a batch of prompts."""
    offsets = np.zeros(len(prompts) + 1, dtype=I64)
    offsets[1:] = np.cumsum([len(p) for p in prompts])
    toks = np.fromiter((t for p in prompts for t in p), dtype=np.uint32, count=int(offsets[-1]))
    return toks, offsets


class Driver:
    """Applies each operation to both managers; `compare()` asserts they agree exactly."""

    def __init__(self, num_blocks: int, block_size: int, mode: str) -> None:
        self.rust = kvcore.KvCacheManager(num_blocks, block_size, mode)
        self.ref = ReferenceManager(num_blocks, block_size, mode)
        self.tokens: dict[int, list[int]] = {}  # each live request's tokens (>= covered)
        self.next_id = 1

    def covered(self, req: int) -> int:
        return self.ref.tables[req].num_tokens

    def admit(self, prompts: list[list[int]], extra: list[int], ns: list[int], wm: int = 0):
        ids = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        totals = [len(p) + e for p, e in zip(prompts, extra, strict=True)]
        toks, offs = flat(prompts)
        got = self.rust.admit(
            np.array(ids, dtype=I64),
            np.array(totals, dtype=I64),
            toks,
            offs,
            np.array(ns, dtype=I64),
            wm,
        )
        want = []
        for i, p in enumerate(prompts):
            hit = self.ref.admit(ids[i], ns[i], p, totals[i], wm)
            if hit is None:
                break
            want.append(hit)
            self.tokens[ids[i]] = list(p) + [7] * extra[i]
        assert got.tolist() == want
        return want

    def allocate(self, reqs: list[int], grow: list[int]) -> None:
        totals = [self.covered(r) + g for r, g in zip(reqs, grow, strict=True)]
        got = self.rust.allocate_slots(np.array(reqs, dtype=I64), np.array(totals, dtype=I64))
        want = 0
        for r, t in zip(reqs, totals, strict=True):
            if not self.ref.allocate_slots(r, t):
                break
            want += 1
            while len(self.tokens[r]) < t:
                self.tokens[r].append((r * 7 + len(self.tokens[r])) % 3)
        assert got == want

    def cache(self, reqs: list[int]) -> None:
        prompts = [self.tokens[r][: self.covered(r)] for r in reqs]
        toks, offs = flat(prompts)
        self.rust.cache_computed(np.array(reqs, dtype=I64), toks, offs)
        for r, p in zip(reqs, prompts, strict=True):
            self.ref.cache_computed(r, p)

    def free(self, reqs: list[int], with_tokens: bool) -> None:
        prompts = [self.tokens[r][: self.covered(r)] for r in reqs]
        if with_tokens:
            toks, offs = flat(prompts)
            self.rust.free(np.array(reqs, dtype=I64), toks, offs)
        else:
            self.rust.free(np.array(reqs, dtype=I64))
        for r, p in zip(reqs, prompts, strict=True):
            self.ref.free(r, p if with_tokens else None)
            del self.tokens[r]

    def fork(self, parents: list[int]) -> None:
        kids = list(range(self.next_id, self.next_id + len(parents)))
        self.next_id += len(parents)
        self.rust.fork(np.array(parents, dtype=I64), np.array(kids, dtype=I64))
        for p, c in zip(parents, kids, strict=True):
            self.ref.fork(p, c)
            self.tokens[c] = self.tokens[p][: self.covered(p)]

    def drain(self) -> None:
        got = self.rust.drain_copy_ops()
        assert got.shape == (len(self.ref.copy_ops), 2)
        assert [tuple(op) for op in got.tolist()] == self.ref.drain_copy_ops()

    def compare(self) -> None:
        r, m = self.rust, self.ref
        r.check_invariants()
        assert r.free_queue().tolist() == m.free_queue
        assert r.ref_counts(np.arange(r.num_blocks, dtype=I64)).tolist() == m.ref
        assert len(r) == len(m.tables)
        for req, t in m.tables.items():
            assert r.block_table(req).tolist() == t.blocks, f"request {req}"
        stats = r.stats()
        assert stats.pop("cached_blocks") == len(m.key)
        assert stats == m.stats
