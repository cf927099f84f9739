"""Faces of kvcore: what a user calls. ``llm`` (the offline ``LLM``), ``cli/`` (the ``kvcore``
command), ``openai/`` (the OpenAI-compatible HTTP server of ``kvcore serve``).

Owns argument parsing, HTTP, text in and out. May import every layer below (engine, runner,
models, retention, tiers, base); ``cli/`` alone may also import ``tools`` and ``scaleout``.
Nothing below imports it.
"""
