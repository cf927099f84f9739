"""Real text for quality checks, from what every Python installation ships (no download)."""

from __future__ import annotations

from typing import Any


def corpus_ids(tokenizer: Any) -> list[int]:
    """Real English text shipped with Python (``pydoc_data.topics``), tokenized."""
    from pydoc_data.topics import topics

    return tokenizer("\n".join(topics[k] for k in sorted(topics))).input_ids
