"""The one exception kvcore_kernels raises for bad input or an unsupported configuration."""


class KernelConfigError(ValueError):
    """A kernel was called with inputs it does not support (shape, dtype, device or feature).

    Raised at call time, before anything is written: the cache and the output are unchanged.
    """
