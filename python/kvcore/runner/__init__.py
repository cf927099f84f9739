"""The model runner: turns a step plan into tensors, runs the forward with paged attention
(the attention op and the backend registered with transformers), CUDA graphs, compilation,
the MLA attention module.

Owns the KV cache tensors and the forward. Imports models, retention, tiers, the base and
``kvcore_kernels``; never the engine or anything above it.
"""
