"""A small pure-Python reference of kvcore's KV manager, the oracle of the differential tests.

Same observable behaviour as the Rust core (block ids, ref counts, free-queue order, hits, copy
ops; freeing cancels orphaned copies), written for clarity, not speed: the free queue is a
list, and the prefix cache is a dict from (namespace, whole token prefix) to block, so the
radix tree and the chained hashes are both "a key per full-block prefix". Radix mode adds
token-granularity hits that end inside a block (ties go to the lowest block id).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Table:
    ns: int
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_cached: int = 0


class ReferenceManager:
    def __init__(self, num_blocks: int, block_size: int, mode: str) -> None:
        self.bs, self.mode = block_size, mode
        self.free_queue = list(range(1, num_blocks))  # head (next allocated) first
        self.ref = [0] * num_blocks
        self.key: dict[int, tuple] = {}  # cached block -> (ns, token prefix through it)
        self.index: dict[tuple, int] = {}  # the inverse
        self.tables: dict[int, Table] = {}
        self.copy_ops: list[tuple[int, int]] = []
        self.max_tokens = (num_blocks - 1) * block_size
        names = ("queries", "query_tokens", "hit_tokens", "evictions", "copy_ops")
        self.stats = dict.fromkeys(names + ("deduplicated_blocks",), 0)

    # -- block pool ---------------------------------------------------------------------------
    def _take(self) -> int:
        b = self.free_queue.pop(0)
        if b in self.key:
            ns, prefix = self.key[b]
            del self.index[self.key.pop(b)]
            self.stats["evictions"] += 1
            if self.mode == "radix":
                # A radix tree cannot keep blocks below an evicted one: drop them, ascending.
                k = len(prefix)
                below = [x for x, (n, p) in self.key.items() if n == ns and p[:k] == prefix]
                for x in sorted(below):
                    del self.index[self.key.pop(x)]
                    if self.ref[x] == 0:
                        self.free_queue.remove(x)
                        self.free_queue.insert(0, x)
        self.ref[b] = 1
        return b

    def _incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free_queue.remove(b)
        self.ref[b] += 1

    def _decref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.key:
                self.free_queue.append(b)  # LRU tail
            else:
                self.free_queue.insert(0, b)

    # -- prefix cache -------------------------------------------------------------------------
    def match(self, ns: int, tokens: list[int], cap: int) -> tuple[int, list[int]]:
        self.stats["queries"] += 1
        self.stats["query_tokens"] += len(tokens)
        bs, limit = self.bs, min(len(tokens), cap)
        blocks: list[int] = []
        if self.mode == "off":
            return 0, blocks
        while (len(blocks) + 1) * bs <= limit:
            b = self.index.get((ns, tuple(tokens[: (len(blocks) + 1) * bs])))
            if b is None:
                break
            blocks.append(b)
        n = len(blocks) * bs
        if self.mode == "radix" and n < limit:
            best, best_len = None, 0
            for b, (bns, prefix) in self.key.items():
                if bns == ns and len(prefix) == n + bs and list(prefix[:n]) == tokens[:n]:
                    tail, rest = prefix[n:], tokens[n:limit]
                    lcp = 0
                    while lcp < min(len(tail), len(rest)) and tail[lcp] == rest[lcp]:
                        lcp += 1
                    if lcp > best_len or (lcp == best_len > 0 and b < best):
                        best, best_len = b, lcp
            if best is not None:
                blocks.append(best)
                n += best_len
        self.stats["hit_tokens"] += n
        return n, blocks

    # -- requests -----------------------------------------------------------------------------
    def admit(self, req: int, ns: int, tokens: list[int] | None, num_tokens: int, wm: int = 0):
        """Match (if tokens) and admit covering num_tokens; the hit length, or None if short."""
        bs = self.bs
        hit, blocks = 0, []
        if tokens is not None:
            hit, blocks = self.match(ns, tokens, min(len(tokens), num_tokens) - 1)
        cow = hit % bs != 0 and num_tokens > hit
        kept = len(blocks) - 1 if cow else len(blocks)
        fresh = -(-num_tokens // bs) - kept
        revived = sum(1 for b in blocks if self.ref[b] == 0)
        if fresh + revived + wm > len(self.free_queue):
            return None
        for b in blocks:
            self._incref(b)
        t = Table(ns, blocks[:kept], num_tokens, hit // bs)
        t.blocks += [self._take() for _ in range(fresh)]
        if cow:
            self.copy_ops.append((blocks[-1], t.blocks[kept]))
            self.stats["copy_ops"] += 1
        self.tables[req] = t
        return hit

    def allocate_slots(self, req: int, total: int) -> bool:
        t, bs = self.tables[req], self.bs
        if total <= t.num_tokens:
            return True
        cow = False
        if t.num_tokens % bs:
            last = t.blocks[-1]
            pins = sum(1 for src, _ in self.copy_ops if src == last)
            cow = self.ref[last] - pins > 1 or last in self.key
        fresh = -(-total // bs) - len(t.blocks) + cow
        if fresh > len(self.free_queue):
            return False
        new = [self._take() for _ in range(fresh)]
        if cow:
            self.copy_ops.append((t.blocks[-1], new[0]))
            self.stats["copy_ops"] += 1
            t.blocks[-1] = new.pop(0)
        t.blocks += new
        t.num_tokens = total
        return True

    def cache_computed(self, req: int, tokens: list[int]) -> None:
        t, bs = self.tables[req], self.bs
        if self.mode == "off":
            return
        while t.num_cached < len(tokens) // bs:
            i = t.num_cached
            b = t.blocks[i]
            if any(dst == b for _, dst in self.copy_ops):
                break  # a pending copy's destination: its KV is not there yet
            if b not in self.key:
                if i > 0 and t.blocks[i - 1] not in self.key:
                    break
                k = (t.ns, tuple(tokens[: (i + 1) * bs]))
                c = self.index.get(k)
                if c is None:
                    self.key[b], self.index[k] = k, b
                elif self.ref[b] == 1:
                    self._incref(c)
                    self._decref(b)
                    t.blocks[i] = c
                    self.stats["deduplicated_blocks"] += 1
                else:
                    break
            t.num_cached += 1

    def free(self, req: int, tokens: list[int] | None = None) -> None:
        self.cache_computed(req, tokens or [])
        for b in reversed(self.tables.pop(req).blocks):
            self._decref(b)
        # Pending copies into blocks nobody holds any more are cancelled, newest first.
        for i in reversed(range(len(self.copy_ops))):
            src, dst = self.copy_ops[i]
            if self.ref[dst] == 0:
                del self.copy_ops[i]
                self._decref(src)

    def fork(self, parent: int, child: int) -> None:
        p = self.tables[parent]
        for b in p.blocks:
            self._incref(b)
        self.tables[child] = Table(p.ns, list(p.blocks), p.num_tokens, p.num_cached)

    def drain_copy_ops(self) -> list[tuple[int, int]]:
        ops, self.copy_ops = self.copy_ops, []
        for src, _ in ops:
            self._decref(src)
        return ops
