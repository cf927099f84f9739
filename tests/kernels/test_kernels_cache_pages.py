"""CPU caches of 2 MiB or more live in transparent huge pages (``kvcore_kernels.cache.zeros``)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import kvcore_kernels as kk
import pytest
import torch
from kvcore_kernels.cache import HUGE_PAGE_BYTES, zeros
from kvcore_kernels.quant import allocate_kv_caches

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The system's THP mode (the bracketed word), None where there is none."""
    try:
        m = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return m[1] if m else None


def mapping_of(addr: int) -> dict[str, int | str]:
    """The /proc/self/smaps entry holding ``addr``: its fields in kB, and its VmFlags."""
    found: dict[str, int | str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            if found is not None:
                break
            if int(m[1], 16) <= addr < int(m[2], 16):
                found = {"start": int(m[1], 16), "end": int(m[2], 16)}
        elif found is not None:
            key, _, value = line.partition(":")
            words = value.split()
            found[key] = " ".join(words) if key == "VmFlags" else int(words[0])
    assert found is not None, f"no mapping holds {addr:#x}"
    return found


needs_thp = pytest.mark.skipif(
    thp_mode() not in ("madvise", "always") or not kk.cache.huge_pages_enabled(),
    reason="transparent huge pages are off here (or KVCORE_HUGE_PAGES=0)",
)


@needs_thp
def test_a_large_cpu_cache_is_zeroed_aligned_private_and_in_huge_pages():
    cache = kk.allocate_kv_cache(1024, 16, 4, 64, torch.bfloat16, "cpu")  # 16 MiB
    assert cache.shape == (1024, 2, 16, 4, 64) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and cache.count_nonzero() == 0
    assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    smaps = mapping_of(cache.data_ptr())
    # Private, as torch.zeros' memory: a shared mapping would be shmem (no THP) and a forked
    # child's writes would land in the parent's cache.
    assert " sh" not in f" {smaps['VmFlags']}" and "hg" in str(smaps["VmFlags"])
    # Every page was touched at allocation; most are huge (the kernel may lend a few 4 KiB).
    assert smaps["Rss"] * 1024 >= cache.numel() * 2
    assert smaps["AnonHugePages"] * 1024 >= cache.numel() * 2 // 2


@needs_thp
def test_the_mapping_lives_as_long_as_a_view_of_the_cache():
    cache = kk.allocate_kv_cache(512, 16, 4, 64, torch.float32, "cpu")
    view = cache[100:200, 1]
    addr = cache.data_ptr()
    del cache
    gc.collect()
    view.fill_(3.0)  # would fault were the mapping gone
    assert float(view.sum()) == 3.0 * view.numel()
    assert mapping_of(addr)["Rss"] > 0
    del view
    gc.collect()
    with pytest.raises(AssertionError, match="no mapping"):
        mapping_of(addr)


@needs_thp
def test_quantized_caches_use_huge_pages_too():
    (cache,) = allocate_kv_caches("int8", 1, 2048, 16, 4, 64, torch.bfloat16, "cpu")
    smaps = mapping_of(cache.buffer.data_ptr())
    assert cache.buffer.count_nonzero() == 0
    assert smaps["AnonHugePages"] * 1024 >= cache.buffer.numel() // 2


def test_small_caches_and_the_switch_keep_torch_zeros():
    small = zeros((4, 2, 16, 1, 64), torch.float32, torch.device("cpu"))
    assert small.count_nonzero() == 0 and small.shape == (4, 2, 16, 1, 64)
    # KVCORE_HUGE_PAGES=0: plain torch.zeros, whatever the size (read at each allocation).
    code = (
        "import torch; from kvcore_kernels.cache import zeros, huge_pages_enabled;"
        "t = zeros((1 << 22,), torch.float32, torch.device('cpu'));"
        "print(huge_pages_enabled(), t.count_nonzero().item())"
    )
    env = dict(os.environ, KVCORE_HUGE_PAGES="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0"]


def test_a_forked_child_writes_its_own_copy():
    """Private mapping: a child process's writes never reach the parent's cache."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    cache = kk.allocate_kv_cache(512, 16, 4, 64, torch.float32, "cpu")
    pid = os.fork()
    if pid == 0:  # child: write (a row: no OpenMP region after fork), leave without atexit
        cache[1, 0, 0].fill_(7.0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache.count_nonzero() == 0
