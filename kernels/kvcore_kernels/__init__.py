"""kvcore_kernels: paged KV-cache kernels (Triton) and their pure-torch twins.

Knows nothing of kvcore: it takes tensors, block tables, slot mappings and sequence metadata.
"""

__version__ = "0.1.0"
