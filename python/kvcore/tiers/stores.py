"""The tiers below host memory: L3, chunk files on a local disk, and L4, a shared Redis.

Both store values made by ``BlockCodec`` under the block's chained key (hex). Both are called
from background threads only, never inside a step, and neither raises: a failed read is a miss
and a failed write is dropped, counted in ``failures``.

L3 (``DiskStore``): one chunk file per block under ``disk_path/<2 hex>/<key>.kvt``, written to
a temporary name and renamed (a reader never sees half a file). ``disk_bytes`` caps the files
this store knows of (those found at start included), evicting least recently used files; a full
disk (ENOSPC or any write error) stops L3 writes for the rest of the run, without failing requests.

L4 (``RedisStore``): ``SET``/``MGET`` under ``<namespace>:<key>``. When Redis is unreachable the
store logs one warning, counts the failures, skips Redis for ``retry_s`` seconds at a time, and
tries again (redis-py reconnects); one info line says when it is back.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import threading
import time
from pathlib import Path

log = logging.getLogger("kvcore")


class DiskStore:
    """L3: chunk files on a local disk with a byte cap and LRU eviction."""

    def __init__(self, path: str | os.PathLike, capacity_bytes: int):
        self.root = Path(path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self.failures = 0
        self.writes_stopped = False
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.used = 0
        for f in sorted(self.root.glob("*/*.kvt"), key=lambda p: p.stat().st_mtime):
            self._files[f.stem] = f.stat().st_size
            self.used += f.stat().st_size

    def _path(self, hexkey: str) -> Path:
        return self.root / hexkey[:2] / f"{hexkey}.kvt"

    def get(self, hexkey: str) -> bytes | None:
        """The value stored under ``hexkey`` (None: absent, unreadable or not a regular file:
        opened non-blocking, so a named pipe or device in its place is a miss, not a hang)."""
        try:
            fd = os.open(self._path(hexkey), os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                with self._lock:
                    self.failures += 1
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
        except OSError:
            return None
        finally:
            os.close(fd)
        with self._lock:
            if hexkey in self._files:
                self._files.move_to_end(hexkey)
        return data

    def put(self, hexkey: str, value: bytes) -> bool:
        """Stores a value (evicting old files past the cap); False when not written."""
        if self.writes_stopped or len(value) > self.capacity:
            return False
        with self._lock:
            if hexkey in self._files:
                self._files.move_to_end(hexkey)
                return True
            while self._files and self.used + len(value) > self.capacity:
                old, size = self._files.popitem(last=False)
                self.used -= size
                self._path(old).unlink(missing_ok=True)
            self._files[hexkey] = len(value)
            self.used += len(value)
        path = self._path(hexkey)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(value)
            os.replace(tmp, path)
            return True
        except OSError as e:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.used -= self._files.pop(hexkey, 0)
                self.failures += 1
                if not self.writes_stopped:
                    self.writes_stopped = True
                    log.warning("kvcore: disk tier write failed (%s); L3 writes stop", e)
            return False


class RedisStore:
    """L4: a shared Redis (values under ``<namespace>:<hex key>``)."""

    def __init__(self, url: str, namespace: str = "kvcore", timeout_s: float = 1.0):
        import redis  # a declared dependency; imported here so that tiers-off never needs it

        self._errors = (redis.exceptions.RedisError, OSError)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.url = url
        self.namespace = namespace
        self.retry_s = 1.0
        self.failures = 0
        self._down_until = 0.0
        self._warned = False
        self._lock = threading.Lock()

    def _name(self, hexkey: str) -> str:
        return f"{self.namespace}:{hexkey}"

    def _call(self, fn, default):
        if time.monotonic() < self._down_until:
            with self._lock:
                self.failures += 1
            return default
        try:
            out = fn()
        except self._errors as e:
            with self._lock:
                self.failures += 1
                self._down_until = time.monotonic() + self.retry_s
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "kvcore: shared KV store %s unreachable (%s): serving by recompute, "
                        "retrying every %.0f s",
                        self.url,
                        e,
                        self.retry_s,
                    )
            return default
        if self._warned:
            with self._lock:
                if self._warned:
                    self._warned = False
                    log.info("kvcore: shared KV store %s is back", self.url)
        return out

    def get_many(self, hexkeys: list[str]) -> list[bytes | None]:
        """Values of ``hexkeys`` in one round trip (None for each on failure)."""
        if not hexkeys:
            return []
        return self._call(
            lambda: self.client.mget([self._name(k) for k in hexkeys]), [None] * len(hexkeys)
        )

    def put_many(self, items: list[tuple[str, bytes]]) -> bool:
        """Stores values in one pipelined round trip."""

        def go() -> bool:
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(self._name(k), v)
            pipe.execute()
            return True

        return bool(items) and self._call(go, False)
