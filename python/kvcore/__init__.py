"""kvcore: a KV-cache engine for LLM inference.

The bookkeeping (block pool, copy-on-write block tables, radix prefix cache, scheduler) is the
Rust extension ``kvcore._kvcore``; the tensors are torch; the kernels are ``kvcore_kernels``.
"""

from kvcore._kvcore import (
    KvCacheManager,
    Scheduler,
    SchedulerStats,
    StepOutput,
    StepPlan,
    __version__,
)
from kvcore.errors import (
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

__all__ = [
    "__version__",
    "KvCacheManager",
    "Scheduler",
    "SchedulerStats",
    "StepOutput",
    "StepPlan",
    "KvCoreError",
    "InvalidArgumentError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "InvalidBlockError",
    "DoubleFreeError",
    "StaleStepError",
    "TooLongError",
    "InvariantError",
]
