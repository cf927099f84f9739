"""Diagnostic (docs/gpu.md, "GPU: the first runs"): the host part of a CUDA-graph decode step,
measured on the CPU. The engine runs the tiny Llama at 64 running requests (256-token prompts)
with every decode step "replayed" by a ``CudaGraphs`` stand-in whose forward costs nothing
(fixed logits), so a step's time is what the host does around a replay: the scheduler, the
static buffers' fill, the sampler (here a NumPy argmax over the vocabulary; on CUDA it runs on
the GPU) and the output processing. Prints the median step and the top of a cProfile.

    python benches/tools/graph_host_step.py [--running 64] [--steps 200]
"""

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams
from kvcore.runner.cuda_graphs import CudaGraphs, graph_sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = tiny_llama(seed=0)
    vocab = model.config.vocab_size

    class NoForwardGraphs(CudaGraphs):
        DEVICE_TYPE = "cpu"

        def _begin(self):
            pass

        def _end(self):
            pass

        def _record(self, run, batch, meta):
            return torch.randn(batch, vocab)

        def _play(self, logits):
            return logits

    n = args.running
    llm = LLM(model, num_blocks=n * 40, block_size=16, max_num_seqs=n, seed=0, enforce_eager=True)
    engine = llm.engine
    runner = engine.runner
    runner.use_op = True
    graphs = NoForwardGraphs(runner.decode_buffers, graph_sizes(n))
    graphs.capture(runner._decode_forward, runner.max_model_len)
    runner.graphs = graphs
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, 256).tolist() for _ in range(n)]
    engine.add_requests(
        prompts, SamplingParams(temperature=0, max_tokens=2 * args.steps + 16, ignore_eos=True)
    )
    for _ in range(n * 256 // 2048 + 4):  # every prompt prefilled (the eager CPU forward)
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    times.sort()
    print(
        f"host_step_ms_b{n}: median {statistics.median(times) * 1e3:.3f}, "
        f"p10 {times[len(times) // 10] * 1e3:.3f}, p90 {times[9 * len(times) // 10] * 1e3:.3f}"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps // 2):
        engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
