"""Old path of ``kvcore_kernels.mla.cache``, kept while kvcore imports ``fp8_row_bytes`` from it."""

from kvcore_kernels.mla.cache import fp8_row_bytes

__all__ = ["fp8_row_bytes"]
