"""Compile the paged-attention Triton kernel for a GPU that is not there (no launch, no timing).

The interpreter (``TRITON_INTERPRET=1``, the CPU tests) runs the kernels as NumPy and accepts
code that the CUDA compiler refuses (a runtime value where a constexpr is needed, two returns of
different shapes). This script compiles the real thing, TTIR to cubin for ``--arch`` (default
sm_90), through ``JITFunction.warmup`` with a stand-in driver, for the plain loop (decode with
splits, prefill with the first autotune configs, window, soft-cap + ALiBi, ``block_mass``) and
the quantized loop of every format (decode with a window and splits, prefill). It needs Triton's
NVIDIA backend (bundled ptxas) but no GPU; it prints one line per kernel compiled and exits
non-zero on the first failure. Compiling is not running: the GPU tests still have to run.

    python benches/compile_attention_sm90.py [--formats int8,kivi2] [--arch 90]
"""

from __future__ import annotations

import argparse
import time

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver


def _stand_in_driver(arch: int) -> None:
    class _Driver(CudaDriver):
        def __init__(self) -> None:  # no CUDA: nothing of the real driver is initialised
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda *a: 0
            self.get_device_capability = lambda d: divmod(arch, 10)
            self.set_current_device = lambda d: None

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

    driver.set_active(_Driver())


class _Warmup:
    """Stands in for ``kernel[grid]``: compiles instead of launching (each config, if given)."""

    def __init__(self, kernel, configs=None) -> None:
        self.kernel, self.configs = kernel, configs or [None]

    def __getitem__(self, grid):
        def compile_only(**kwargs):
            for cfg in self.configs:
                extra = {} if cfg is None else dict(cfg.kwargs, num_warps=cfg.num_warps,
                                                    num_stages=cfg.num_stages)  # fmt: skip
                start = time.time()
                compiled = self.kernel.warmup(grid=grid, **kwargs, **extra)
                print(f"{self.kernel.__name__}: cubin {len(compiled.asm['cubin'])} bytes, "
                      f"{time.time() - start:.1f} s", flush=True)  # fmt: skip

        return compile_only


def _meta(reqs: list[tuple[int, int]], block_size: int):
    import kvcore_kernels as kk

    lens = [c + q for c, q in reqs]
    need = [(n + block_size - 1) // block_size for n in lens]
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32)
    first = 1
    for r, n in enumerate(need):
        table[r, :n] = torch.arange(first, first + n)
        first += n
    qsl = torch.tensor([0] + torch.tensor([q for _, q in reqs]).cumsum(0).tolist())
    meta = kk.plan_attention(qsl.int(), torch.tensor(lens, dtype=torch.int32), table, block_size)
    return meta, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2,int8,int4,int4_k8,int2,kivi4,kivi2")
    ap.add_argument("--no-plain", action="store_true")
    args = ap.parse_args()
    _stand_in_driver(args.arch)
    from kvcore_kernels import paged_triton
    from kvcore_kernels.attention_triton import paged_attention_triton
    from kvcore_kernels.quant import allocate_kv_caches
    from kvcore_kernels.quant.attention_triton import paged_attention_quant_triton

    paged_triton.check_triton_device = lambda *a: None  # CPU tensors stand in for CUDA ones
    prefill = paged_triton._paged_attention_prefill
    paged_triton._paged_attention_prefill = _Warmup(prefill.fn, paged_triton.PREFILL_CONFIGS[:2])
    paged_triton.paged_attention_kernel = _Warmup(paged_triton.paged_attention_kernel)
    paged_triton.merge_splits_kernel = _Warmup(paged_triton.merge_splits_kernel)

    bs, hq, hk = 16, 8, 2
    if not args.no_plain:
        for dtype, d in ((torch.bfloat16, 128), (torch.float32, 64)):
            for reqs, feats in (
                ([(3000, 1)], {}),
                ([(100, 30), (0, 40)], {}),
                ([(3000, 1)], dict(sliding_window=512)),
                ([(100, 30)], dict(soft_cap=30.0, alibi_slopes=torch.ones(hq))),
                ([(100, 1)], dict(block_mass=True)),
            ):
                meta, num_blocks = _meta(reqs, bs)
                if "block_mass" in feats:
                    feats = dict(block_mass=torch.zeros(meta.block_table.shape))
                cache = torch.zeros(num_blocks, 2, bs, hk, d, dtype=dtype)
                q = torch.zeros(meta.num_tokens, hq, d, dtype=dtype)
                paged_attention_triton(q, cache, meta, scale=0.1, **feats)
    for fmt in filter(None, args.formats.split(",")):
        for reqs, feats in (([(3000, 1)], dict(sliding_window=700)), ([(100, 30), (0, 40)], {})):
            meta, num_blocks = _meta(reqs, bs)
            (cache,) = allocate_kv_caches(fmt, 1, num_blocks, bs, hk, 128, torch.bfloat16, "cpu",
                                          num_residual_blocks=4)  # fmt: skip
            q = torch.zeros(meta.num_tokens, hq, 128, dtype=torch.bfloat16)
            paged_attention_quant_triton(q, cache, meta, scale=0.1, **feats)
    print("all compiled")


if __name__ == "__main__":
    main()
