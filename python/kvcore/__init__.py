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
    StepFailedError,
    TooLongError,
    UnknownRequestError,
)

# The serving API imports torch and transformers: loaded on first use (PEP 562), so that
# ``import kvcore`` for the Rust core alone stays light.
_LAZY = {
    "LLM": "kvcore.entrypoints.llm",
    "LLMEngine": "kvcore.engine.llm_engine",
    "SamplingParams": "kvcore.params",
    "RequestOutput": "kvcore.outputs",
    "CompletionOutput": "kvcore.outputs",
    "RequestMetrics": "kvcore.outputs",
    "CacheConfig": "kvcore.config",
    "SchedulerConfig": "kvcore.config",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvcore' has no attribute {name!r}")


__all__ = [
    "__version__",
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "CacheConfig",
    "SchedulerConfig",
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
    "StepFailedError",
]
