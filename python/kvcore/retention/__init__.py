"""Retention: which KV blocks a sequence may give up. ``spec`` parses the policies
(``window``, ``sink+window``, ``h2o``), ``release`` decides the engine's exact window release
and per-request policies, ``h2o`` accumulates attention mass and picks blocks to drop.

Imports models and the base; never the runner, the engine or anything above.
"""
