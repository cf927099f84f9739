"""SmolLM2's prefill GEMM shapes (1,024 rows), one thread, GFLOP/s of the best of 5 calls:
kvcore's native linear on the bf16 pack (the blocked AVX2 GEMM on an AVX2-only CPU), MKL's fp32
``mm`` on fp32 copies, and oneDNN's packed fp32 linear."""

import time

import torch
from kvcore_kernels import linear_cpu

DNN = torch.ops.mkldnn._linear_pointwise
SHAPES = [(1024, 576, 960), (1024, 576, 3072), (1024, 1536, 576), (1024, 576, 576)]


def best_of(f, n: int = 5) -> float:
    f()
    best = 1e9
    for _ in range(n):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    torch.set_num_threads(1)
    for m, k, n in SHAPES:
        w = (torch.randn(n, k) * k**-0.5).bfloat16()
        x = torch.randn(m, k).bfloat16()
        packed = linear_cpu.pack_linear(w)
        wf, xf = w.float(), x.float()
        wp = torch.ops.mkldnn._reorder_linear_weight(wf, m)
        t_nat = best_of(lambda x=x, p=packed: linear_cpu.linear(x, p))
        t_mkl = best_of(lambda xf=xf, wf=wf: torch.mm(xf, wf.t()))
        t_dnn = best_of(lambda xf=xf, wp=wp: DNN(xf, wp, None, "none", [], ""))
        fl = 2 * m * k * n / 1e9
        print(f"{m}x{k}x{n}: native {fl / t_nat:.1f} GF/s, mkl {fl / t_mkl:.1f}, "
              f"onednn packed {fl / t_dnn:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
