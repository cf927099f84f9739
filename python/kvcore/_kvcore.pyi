"""Type stubs for the Rust extension ``kvcore._kvcore`` (kept honest by ``mypy.stubtest``)."""

# Every name the module exports (pyo3 builds __all__); keep in step with the binary.
__all__ = [
    "DoubleFreeError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvariantError",
    "KvCoreError",
    "StaleStepError",
    "TooLongError",
    "UnknownRequestError",
    "__version__",
]

__version__: str

class KvCoreError(Exception):
    """Base class of every kvcore error."""

class InvalidArgumentError(KvCoreError):
    """A malformed argument."""

class UnknownRequestError(KvCoreError):
    """An unknown request id."""

class DuplicateRequestError(KvCoreError):
    """A request id already in use."""

class InvalidBlockError(KvCoreError):
    """A block id out of range or the null block."""

class DoubleFreeError(KvCoreError):
    """Freeing what holds no reference."""

class StaleStepError(KvCoreError):
    """An update for a step that is not outstanding."""

class TooLongError(KvCoreError):
    """An input longer than the cache or model can hold."""

class InvariantError(KvCoreError):
    """Corrupted internal state (a bug)."""
