"""Incremental detokenization and stop strings.

Only completions that need text while they run (stop strings, streaming) pay per-token work, and
that work is the tokenizers library's Rust ``DecodeStream`` (it holds back bytes that do not yet
form a whole character). Other completions are decoded once, when they finish.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """The text of one completion, grown token by token, watching for stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # only kept for slow tokenizers (full re-decode)
        self._stop = stop or []
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self.text = ""
        self.stopped_by: str | None = None

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; returns the new text. Stops growing once a stop string matched."""
        if self.stopped_by is not None:
            return ""
        before = len(self.text)
        if self._stream is not None and self._backend is not None:
            for t in token_ids:
                piece = self._stream.step(self._backend, t)
                if piece:
                    self.text += piece
                    if self._stop and self._find_stop(len(piece)):
                        break
        else:
            self._ids.extend(token_ids)
            self.text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
            if self._stop:
                self._find_stop(len(self.text) - before)
        return self.text[before:]

    def _find_stop(self, num_new: int) -> bool:
        """Look for a stop string ending in the last ``num_new`` characters; cut the text there."""
        start = max(0, len(self.text) - num_new - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
        self.stopped_by = s
        return True
