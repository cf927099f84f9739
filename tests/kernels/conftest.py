"""Kernel tests: the Triton kernels run on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated, i.e. when kvcore_kernels' Triton
modules are first imported; nothing imports them during collection, so setting it here (CPU-only
machines only) is early enough. It changes nothing else: backend "auto" still picks the torch
twin for CPU tensors, so other tests in the session are unaffected.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen(request):
    """A generator with a fresh seed each run (set KVCORE_TEST_SEED to replay one).

    The seed is in the test's report (``user_properties``) and in ``gen.initial_seed()``.
    """
    seed = int(os.environ.get("KVCORE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)
