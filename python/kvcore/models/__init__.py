"""Models: loading checkpoints (safetensors cache, the GGUF packages, tiny seeded configs),
dtypes, per-layer windows, KV sizes per block and MLA geometry, and kvcore's own model code
(``llama``, ``gemma`` built from ``layers/``; ``native`` picks it or transformers' modules;
``step_graphs`` replays a small step's recorded native calls).

Owns what a model *is*; knows nothing of requests or steps (a forward receives the step's
attention as a callable, ``layers.attention.StepAttention``). Imports only the base and
``kvcore_kernels``.
"""
