"""The kvcore exception hierarchy (defined in Rust, ``rust/src/py/errors.rs``).

Every error kvcore raises for bad input is a ``KvCoreError``. A call that raises has changed
nothing.
"""

from kvcore._kvcore import (
    DoubleFreeError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidBlockError,
    InvariantError,
    KvCoreError,
    StaleStepError,
    TooLongError,
    UnknownRequestError,
)


class StepFailedError(KvCoreError):
    """An engine step failed (an exception in the forward or sampling): the requests it had
    scheduled were aborted with ``RequestOutput.error`` set; the engine keeps serving."""


__all__ = [
    "KvCoreError",
    "InvalidArgumentError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "InvalidBlockError",
    "DoubleFreeError",
    "StaleStepError",
    "TooLongError",
    "InvariantError",
    "StepFailedError",
]
