"""The sweep's quantized decode rows alone (``bench_attention_cpu.quant_row``), one thread, for
the seeds in argv[1] (comma-separated): each format's speed over bf16's, warm and cold. Run by
``ab.sh``, one process per build of the native extension, alternated."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import bench_attention_cpu as B  # noqa: E402

torch.set_num_threads(1)
out = []
for s in [int(x) for x in sys.argv[1].split(",")]:
    gen = torch.Generator().manual_seed(s)
    for batch, length in [(8, 4096), (1, 16384), (8, 16384)]:
        ms, cold = B.quant_row(gen, batch, length, 1.5)
        warm_r = " ".join(f"{k}={ms['bf16'] / v:.2f}" for k, v in ms.items() if k != "bf16")
        cold_r = " ".join(f"{k}={cold['bf16'] / v:.2f}" for k, v in cold.items() if k != "bf16")
        out.append(f"s{s} {batch}x{length} {warm_r} bf16={ms['bf16']:.2f}ms | cold {cold_r}")
print("\n".join(out))
