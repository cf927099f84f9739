"""What the live dashboard shows of one engine: a read-only picture of its KV cache.

``LLMEngine.inspect()`` takes ONE Rust call under the engine's state lock
(``kvcore._kvcore.kv_snapshot``: every block's ref count and caching flag, every live table, the
scheduler's counters, all as NumPy arrays) plus a copy of the few per-request facts the
``CacheLedger`` keeps (request id, cache salt, retention kind, first prompt tokens); everything
else (the block map, owners, hot prefixes, tenants) is computed here, outside the lock, with
vectorised NumPy. Cost: O(blocks + table entries) per call, ~0.1 ms under the lock for a few
thousand blocks; the server asks at most once a second however many pages are open.

Block states, one per block of the pool (the null block excluded)::

    free     ref count 0, not in the prefix cache
    cached   ref count 0, in the prefix cache (evictable; a hit revives it)
    running  ref count 1 (held by one request)
    shared   ref count > 1 (prefix hits, forks, pending copies)
"""

from __future__ import annotations

import collections
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

FREE, CACHED, RUNNING, SHARED = 0, 1, 2, 3
STATE_NAMES = ("free", "cached", "running", "shared")
HEAD_TOKENS = 32  # prompt tokens kept per request / prefix, to name it
MAX_CELLS = 2048  # the map groups blocks into at most this many cells


@dataclass(slots=True)
class _Req:
    request_id: str
    salt: str | None
    retention: str  # "full", "window", "sink", "h2o"
    head: tuple[int, ...]


@dataclass(slots=True)
class _Prefix:
    salt: str | None
    head: tuple[int, ...]
    num_tokens: int
    hits: int = 0
    last_use: float = 0.0


class CacheLedger:
    """Per-request facts and prefix-cache hits, kept by ``LLMEngine`` under its state lock.

    O(1) per request (plus hashing the hit prefix once); at most ``max_prefixes`` prefixes are
    remembered (least recently hit dropped first).
    """

    def __init__(self, block_size: int = 1, max_prefixes: int = 512):
        self.block_size = block_size
        self.reqs: dict[int, _Req] = {}
        self.prefixes: collections.OrderedDict[tuple, _Prefix] = collections.OrderedDict()
        self.max_prefixes = max_prefixes
        self.tenant_hits: collections.Counter[str | None] = collections.Counter()
        self.tenant_hit_tokens: collections.Counter[str | None] = collections.Counter()
        self.tenant_requests: collections.Counter[str | None] = collections.Counter()
        self.last_hit: dict[int, tuple] = {}  # internal id -> its prefix key (live requests)

    def admitted(
        self, internal_id: int, request_id: str, salt: str | None, retention: str, tokens: list
    ) -> None:
        self.reqs[internal_id] = _Req(request_id, salt, retention, tuple(tokens[:HEAD_TOKENS]))
        self.tenant_requests[salt] += 1

    def first_scheduled(self, internal_id: int, hit: int, tokens: list, now: float) -> None:
        """A request's prefix-cache hit of ``hit`` tokens at its first step."""
        info = self.reqs.get(internal_id)
        if info is None or hit < self.block_size:  # a prefix is at least one full block
            return
        # A prefix is named by its first HEAD_TOKENS tokens: hits that differ only further on
        # (a shared system prompt followed by different questions) count for one prefix.
        head = tuple(tokens[: min(hit, HEAD_TOKENS)])
        key = (info.salt, head)
        p = self.prefixes.get(key)
        if p is None:
            p = self.prefixes[key] = _Prefix(info.salt, head, hit)
            if len(self.prefixes) > self.max_prefixes:
                self.prefixes.popitem(last=False)
        else:
            self.prefixes.move_to_end(key)
            p.num_tokens = max(p.num_tokens, hit)
        p.hits += 1
        p.last_use = now
        self.last_hit[internal_id] = key
        self.tenant_hits[info.salt] += 1
        self.tenant_hit_tokens[info.salt] += hit

    def retired(self, internal_id: int) -> None:
        self.reqs.pop(internal_id, None)
        self.last_hit.pop(internal_id, None)

    def copy_for(self, internal_ids: np.ndarray) -> dict[str, Any]:
        """The facts the view needs, copied (cheap) so the view is built outside the lock."""
        reqs = self.reqs
        return {
            "reqs": [reqs.get(i) for i in internal_ids.tolist()],
            "hit_keys": [self.last_hit.get(i) for i in internal_ids.tolist()],
            "prefixes": sorted(self.prefixes.items(), key=lambda kv: -kv[1].hits)[:10],
            "tenant_hits": dict(self.tenant_hits),
            "tenant_hit_tokens": dict(self.tenant_hit_tokens),
            "tenant_requests": dict(self.tenant_requests),
        }


def block_states(ref_counts: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """One state per block (FREE, CACHED, RUNNING, SHARED)."""
    st = np.where(cached.astype(bool), CACHED, FREE).astype(np.int8)
    st[ref_counts == 1] = RUNNING
    st[ref_counts > 1] = SHARED
    return st


@functools.lru_cache(maxsize=4096)
def _detok_cached(tokenizer: Any, head: tuple[int, ...]) -> str:
    return _detok_uncached(tokenizer, head)


def _detok(tokenizer: Any, head: tuple[int, ...]) -> str:
    """The first tokens as text (cached: a running request is named once a second)."""
    try:
        return _detok_cached(tokenizer, head)
    except TypeError:  # an unhashable tokenizer
        return _detok_uncached(tokenizer, head)


def _detok_uncached(tokenizer: Any, head: tuple[int, ...]) -> str:
    if tokenizer is None:
        return " ".join(map(str, head))
    try:
        return str(tokenizer.decode(list(head), skip_special_tokens=False))
    except Exception:  # noqa: BLE001 - a name for a picture, never an error
        return " ".join(map(str, head))


def build_view(raw: dict[str, Any], facts: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The JSON-ready picture (the dashboard's ``kv`` section) from one snapshot."""
    t0 = time.perf_counter()
    ref, cached = raw["ref_counts"], raw["cached"]
    states = block_states(ref, cached)[1:]  # without the null block
    num_blocks = len(states)
    counts = np.bincount(states, minlength=4)
    offsets, blocks = raw["offsets"].astype(np.int64), raw["blocks"].astype(np.int64)
    per_req = np.diff(offsets)
    owner_row = np.repeat(np.arange(len(per_req)), per_req)
    held = blocks > 0
    reqs = facts["reqs"]
    # Owners by block (a request once, whatever its samples and KV groups), first owner's prefix.
    group = max(1, -(-num_blocks // MAX_CELLS))
    owners: dict[int, list[int]] = {}
    if group == 1:  # hover names owners only where a cell is one block
        for row, b in zip(owner_row[held].tolist(), blocks[held].tolist(), strict=True):
            rows = owners.setdefault(b, [])
            if not rows or reqs[rows[-1]] is not reqs[row] or reqs[row] is None:
                rows.append(row)
    cells = _cells(states, group)
    names: list[dict[str, Any]] = [
        {
            "id": r.request_id if r else f"#{int(i)}",
            "salt": r.salt if r else None,
            "retention": r.retention if r else "full",
            "prefix": _detok(tokenizer, r.head) if r else "",
        }
        for i, r in zip(raw["req_ids"].tolist(), reqs, strict=True)
    ]
    # Hover text per cell: owners and the prefix of the first owner (cells of one block).
    hover: dict[int, str] = {}
    for b, rows in owners.items():
        ids = list(dict.fromkeys(names[r]["id"] for r in rows))
        who = ", ".join(ids[:4]) + (" …" if len(ids) > 4 else "")
        hover[b - 1] = f"block {b}: {who} | {names[rows[0]]['prefix'][:60]!r}"
    # Per tenant (cache_salt): distinct blocks held, requests, prefix hits.
    tenants: dict[str, dict[str, int]] = {}
    salt_of_row = [n["salt"] or "(shared)" for n in names]
    salts = list(dict.fromkeys(salt_of_row))
    if salts:  # distinct (tenant, block) pairs, vectorised
        index = {x: k for k, x in enumerate(salts)}
        t_of_row = np.asarray([index[x] for x in salt_of_row], np.int64)
        pairs = np.unique(t_of_row[owner_row[held]] * (num_blocks + 1) + blocks[held])
        per = np.bincount(pairs // (num_blocks + 1), minlength=len(salts)).tolist()
        for salt, n in zip(salts, per, strict=True):
            tenants[salt] = {"blocks": int(n), "requests": 0}
    for salt, _rid in set(zip(salt_of_row, raw["req_ids"].tolist(), strict=True)):
        tenants.setdefault(salt, {"blocks": 0, "requests": 0})["requests"] += 1
    for salt, hits in facts["tenant_hits"].items():
        tenants.setdefault(salt or "(shared)", {"blocks": 0, "requests": 0})["hits"] = hits
    for salt, tok in facts["tenant_hit_tokens"].items():
        tenants[salt or "(shared)"]["hit_tokens"] = tok
    live_keys = collections.Counter(k for k in facts["hit_keys"] if k is not None)
    now = time.perf_counter()
    bs = int(raw.get("block_size", 16))
    hot = [
        {
            "salt": p.salt,
            "text": _detok(tokenizer, p.head),
            "tokens": p.num_tokens,
            "blocks": -(-p.num_tokens // bs),
            "pinned": p.num_tokens // bs if live_keys.get(key) else 0,
            "users": live_keys.get(key, 0),
            "hits": p.hits,
            "last_use_s_ago": round(now - p.last_use, 1),
        }
        for key, p in facts["prefixes"]
    ]
    released: collections.Counter[str] = collections.Counter()
    for row, n in enumerate(raw["num_released"].tolist()):
        if n:
            released[names[row]["retention"]] += n
    st = raw["stats"]
    return {
        "num_blocks": num_blocks,
        "group": group,
        "counts": dict(zip(STATE_NAMES, map(int, counts), strict=True)),
        "cells": cells,
        "hover": hover,
        "requests": names,
        "hot_prefixes": hot,
        "tenants": tenants,
        "retention": {
            "released_total": int(st.num_released_blocks),
            "released_live_by_policy": dict(released),
        },
        "num_running": int(st.num_running),
        "num_waiting": int(st.num_waiting),
        "num_free_blocks": int(st.num_free_blocks),
        "num_l2_entries": int(raw["num_l2_entries"]),
        "build_ms": round((time.perf_counter() - t0) * 1e3, 3),
    }


def _cells(states: np.ndarray, group: int) -> str:
    """The map as a string, one character per cell ('0'..'3': free, cached, running, shared);
    a cell of several blocks shows the most referenced state among them."""
    if group > 1:
        pad = (-len(states)) % group
        states = np.concatenate([states, np.zeros(pad, np.int8)]).reshape(-1, group).max(axis=1)
    return (states + ord("0")).astype(np.uint8).tobytes().decode()


def engine_view(engine: Any) -> dict[str, Any]:
    """The engine side of the dashboard's picture: ``inspect()`` and the tiers' figures, as
    plain lists and numbers (sent as one utility call when the engine runs in its own process)."""
    kv = engine.inspect()
    return {"kv": kv, "tiers": _tiers_view(engine, kv)}


def _tiers_view(engine: Any, kv: dict[str, Any]) -> dict[str, Any] | None:
    tm = getattr(engine, "tiers", None)
    if tm is None:
        return None
    st = engine.scheduler.tier_stats()
    fig = engine.tier_figures()
    disk = getattr(tm, "disk", None)
    block_bytes = max(1, int(getattr(tm, "block_bytes", 1)))
    c = kv["counts"]

    def finite(x: Any) -> float | None:  # JSON: None for a missing or NaN percentile
        return None if x is None or not math.isfinite(x) else round(float(x), 3)

    return {
        "resident": {
            "L1": c["running"] + c["shared"] + c["cached"],
            "L2": int(st["l2_entries"]),
            "L3": (int(disk.used) // block_bytes) if disk is not None else None,
            "L4": int(st["published_blocks"]) if getattr(tm, "remote", None) else None,
        },
        "loaded_blocks": int(st["loaded_blocks"]),
        "offloaded_blocks": int(st["offloaded_blocks"]),
        "fetched_blocks": int(st["fetched_blocks"]),
        "fetch_p50_ms": finite(fig.get("tier_fetch_p50_ms")),
        "fetch_p95_ms": finite(fig.get("tier_fetch_p95_ms")),
        "load_p50_ms": finite(fig.get("tier_load_p50_ms")),
    }
