"""Pure-Python peers measured in the same run as kvcore: written for speed in plain Python.

PyFreeList: a paged allocator (deque free list, dict of tables), no prefix cache.
PyHashPrefixCache: a block-hash prefix cache in the style of vLLM's Python BlockPool
(chained hashes of block token tuples, an OrderedDict free queue that is also the LRU of
cached unreferenced blocks, ref counts), at block granularity.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class PyFreeList:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free_blocks = deque(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.bs = block_size

    def admit(self, ids: list[int], nums: list[int]) -> int:
        for i, (rid, n) in enumerate(zip(ids, nums, strict=True)):
            k = -(-n // self.bs)
            if k > len(self.free_blocks):
                return i
            pop = self.free_blocks.popleft
            self.tables[rid] = [pop() for _ in range(k)]
        return len(ids)

    def free(self, ids: list[int]) -> None:
        for rid in ids:
            self.free_blocks.extendleft(reversed(self.tables.pop(rid)))


class PyHashPrefixCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.free_q: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # cached block -> hash
        self.cached: dict[int, int] = {}  # hash -> block
        self.tables: dict[int, tuple[list[int], list[int]]] = {}  # id -> (blocks, hashes)
        self.hit_tokens = self.query_tokens = 0

    def _hashes(self, toks: list[int], start: int, parent: int, n: int) -> list[int]:
        bs, out = self.bs, []
        for k in range(start, n):
            parent = hash((parent, tuple(toks[k * bs : (k + 1) * bs])))
            out.append(parent)
        return out

    def admit(self, rid: int, prompt: list[int], total: int) -> bool:
        bs = self.bs
        self.query_tokens += len(prompt)
        hits: list[int] = []
        hashes: list[int] = []
        parent = 0
        for k in range((len(prompt) - 1) // bs):
            parent = hash((parent, tuple(prompt[k * bs : (k + 1) * bs])))
            b = self.cached.get(parent)
            if b is None:
                break
            hits.append(b)
            hashes.append(parent)
        fresh = -(-total // bs) - len(hits)
        if fresh + sum(1 for b in hits if self.ref[b] == 0) > len(self.free_q):
            return False
        for b in hits:
            if self.ref[b] == 0:
                del self.free_q[b]
            self.ref[b] += 1
        blocks = hits + [self._take() for _ in range(fresh)]
        self.tables[rid] = (blocks, hashes)
        self.hit_tokens += len(hits) * bs
        return True

    def _take(self) -> int:
        b, _ = self.free_q.popitem(last=False)
        h = self.hash_of.pop(b, None)
        if h is not None:
            del self.cached[h]
        self.ref[b] = 1
        return b

    def free(self, rid: int, seq: list[int]) -> None:
        blocks, hashes = self.tables.pop(rid)
        n_full = len(seq) // self.bs
        parent = hashes[-1] if hashes else 0
        hashes += self._hashes(seq, len(hashes), parent, n_full)
        for b, h in zip(blocks, hashes, strict=False):
            if b not in self.hash_of and h not in self.cached:
                self.hash_of[b], self.cached[h] = h, b
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_q[b] = None
                if b not in self.hash_of:
                    self.free_q.move_to_end(b, last=False)
