"""Background I/O of the tiers on daemon threads, with deadlines.

A tier read or write can block for good (a hung NFS mount, a named pipe, a Redis that accepts
and never answers). ``IoPool`` runs such calls on daemon threads, so a call that never returns
can delay nothing but itself: ``shutdown(timeout)`` waits for the queued work up to a deadline,
then abandons what is left, and the process still exits (``concurrent.futures`` joins its
workers at exit with no deadline, which is why it is not used here).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class IoPool:
    """``n`` daemon threads that run submitted calls in order of submission."""

    def __init__(self, n: int, name: str):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its Future (cancelled, never run, once the pool is shut)."""
        fut: Future = Future()
        if self._closed:
            fut.cancel()
        else:
            self._queue.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the Future
                fut.set_exception(e)

    def shutdown(self, timeout: float) -> bool:
        """Run what is queued, for at most ``timeout`` seconds; True if every thread ended.
        Work still queued at the deadline is cancelled; a call still blocked is abandoned (its
        daemon thread never holds the process)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + max(0.0, timeout)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = any(t.is_alive() for t in self._threads)
        if alive:  # cancel what the blocked threads will never reach
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        return not alive
