"""Models: loading checkpoints (safetensors cache, the GGUF packages, tiny seeded configs),
dtypes, per-layer windows, KV sizes per block and MLA geometry.

Owns what a model *is*; knows nothing of requests or steps. Imports only the base and
``kvcore_kernels``.
"""
