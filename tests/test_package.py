"""The package imports and exposes its exception hierarchy."""

import kvcore
import kvcore_kernels


def test_versions():
    assert kvcore.__version__ == "0.1.0"
    assert kvcore_kernels.__version__ == "0.1.0"


def test_error_hierarchy():
    for cls in (
        kvcore.InvalidArgumentError,
        kvcore.UnknownRequestError,
        kvcore.DuplicateRequestError,
        kvcore.InvalidBlockError,
        kvcore.DoubleFreeError,
        kvcore.StaleStepError,
        kvcore.TooLongError,
        kvcore.InvariantError,
    ):
        assert issubclass(cls, kvcore.KvCoreError)
    assert issubclass(kvcore.KvCoreError, Exception)
