"""The CUDA-graph ladder's bookkeeping on the CPU: sizes, buckets, padding rows that touch
nothing, and a padded decode step that gives the unpadded logits (issue 15)."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # before any Triton module of kvcore_kernels is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvcore import InvalidArgumentError  # noqa: E402
from kvcore.models.loader import tiny_llama  # noqa: E402
from kvcore.runner.cuda_graphs import (  # noqa: E402
    CudaGraphs,
    DecodeBuffers,
    _EmptyPlan,
    graph_sizes,
)
from kvcore.runner.model_runner import ModelRunner  # noqa: E402
from test_engine import SMALL  # noqa: E402
from test_engine_runner import _plan  # noqa: E402

GPU = dict(SMALL, hidden_size=128)  # head_dim 32: a size the Triton kernels take


def _greedy_case(device: str = "cpu"):
    """The tiny model, five prompts of mixed lengths, greedy params and engine options."""
    from kvcore.params import SamplingParams

    model = tiny_llama(seed=3, **GPU).to(device)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, GPU["vocab_size"], n).tolist() for n in (3, 17, 9, 30, 5)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 3, 9, 5, 7)]
    kw = dict(block_size=16, num_blocks=64, max_num_seqs=8, seed=0, device=device)
    return model, prompts, params, kw


def test_ladder_sizes():
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(64, [8, 1, 8, 64]) == [1, 8, 64]
    for bad in ([0, 4], [65], []):
        with pytest.raises(InvalidArgumentError):
            graph_sizes(64, bad)


def test_bucket_is_the_smallest_size_that_fits():
    buf = DecodeBuffers(64, 4, 16, torch.device("cpu"))
    sizes = graph_sizes(64)
    assert [buf.bucket(n, sizes) for n in (1, 3, 4, 5, 17, 64, 65)] == [1, 4, 4, 8, 24, 64, None]


def _prefill_three(runner):
    """Prefill three requests (5, 9 and 3 random tokens; block size 4) through ``runner``;
    returns the plan of their next decode step."""
    tables = [[3, 7], [1, 9, 2], [5]]
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 9, 3)]
    prefill = _plan(prompts, tables, 4, [0, 0, 0])
    runner.execute(prefill, prefill.query_start_loc[1:] - 1)
    return _plan([[11], [12], [13]], tables, 4, [5, 9, 3])


def _decode(n, width, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, width * 4 + 1, n)
    table = np.zeros((n, width), np.int32)
    for r in range(n):
        table[r, : -(-lens[r] // 4)] = rng.integers(1, 50, -(-lens[r] // 4))
    pos = lens - 1
    return SimpleNamespace(
        input_ids=rng.integers(0, 100, n),
        positions=pos,
        slot_mapping=table[np.arange(n), pos // 4] * 4 + pos % 4,
        seq_lens=lens.astype(np.int32),
        block_table=table,
    )


def test_fill_pads_rows_into_the_null_block():
    buf = DecodeBuffers(8, 6, 4, torch.device("cpu"))
    plan = _decode(3, 5)
    buf.fill(plan, 8)
    ids, pos, slots, rows = buf.inputs(8)
    assert ids[0, :3].tolist() == plan.input_ids.tolist() and ids[0, 3:].eq(0).all()
    assert slots[:3].tolist() == plan.slot_mapping.tolist()
    assert slots[3:].lt(4).all()  # slot 0: the null block, which store_kv skips
    assert pos[0, 3:].eq(0).all() and rows.tolist() == list(range(8))
    meta = buf.metadata(8)
    assert meta.seq_lens.tolist() == plan.seq_lens.tolist() + [1] * 5
    assert meta.block_table[:3, :5].tolist() == plan.block_table.tolist()
    assert meta.block_table[:3, 5:].eq(0).all() and meta.block_table[3:].eq(0).all()
    assert meta.query_start_loc.tolist() == list(range(9)) and meta.num_tokens == 8
    # A smaller step afterwards leaves no stale rows behind.
    small = _decode(1, 2, seed=1)
    buf.fill(small, 2)
    meta = buf.metadata(2)
    assert meta.seq_lens.tolist() == [int(small.seq_lens[0]), 1]
    assert meta.block_table[0, 2:].eq(0).all() and meta.block_table[1].eq(0).all()


def test_fill_refuses_what_does_not_fit():
    buf = DecodeBuffers(4, 3, 4, torch.device("cpu"))
    for plan, batch in ((_decode(5, 3), 8), (_decode(2, 4), 2), (_decode(3, 3), 2)):
        with pytest.raises(InvalidArgumentError):
            buf.fill(plan, batch)
    mixed = _decode(2, 3)
    mixed.input_ids = np.zeros(3, np.int64)  # a prefill token: not a decode-only step
    assert not buf.fits(mixed)


@pytest.mark.parametrize("compile", [False, True])
def test_padded_decode_equals_unpadded_and_touches_no_block(compile):
    """Runner.execute_padded runs a decode step as a graph would (static buffers, padded to the
    bucket, through the custom op; compiled with aot_eager here): the real rows' logits equal the
    plain step's, and the padding rows write nothing: the cache differs from the unpadded
    step's nowhere but float noise in the real rows' own slots."""
    torch.manual_seed(0)
    model = tiny_llama(seed=0, **SMALL)
    runner = ModelRunner(
        model,
        num_blocks=16,
        block_size=4,
        compile=compile,
        compile_backend="aot_eager",
        max_num_seqs=8,
        max_model_len=32,
    )
    decode = _prefill_three(runner)
    decode.seq_lens = decode.seq_lens.astype(np.int64)
    before = [c.clone() for c in runner.kv_caches]
    want = runner.execute(decode, np.arange(3))
    after_plain = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before, strict=True):
        c.copy_(b)
    got = runner.execute_padded(decode, np.arange(3), batch=8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    written = torch.zeros(16 * 4, dtype=torch.bool)
    written[torch.as_tensor(decode.slot_mapping)] = True
    written = written.view(16, 1, 4, 1, 1).expand_as(before[0])
    for c, b, p in zip(runner.kv_caches, before, after_plain, strict=True):
        assert torch.equal(c[~written], b[~written])  # every other slot, null block included
        torch.testing.assert_close(c[written], p[written], rtol=1e-5, atol=1e-5)
        assert not torch.equal(c[written], b[written])  # the real rows did write


# The Triton kernels on CPU tensors: only under the interpreter (set above where no GPU is).
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels on CPU tensors under TRITON_INTERPRET=1",
)


@needs_interpreter
def test_replay_with_capture_time_metadata_equals_plain_step_on_triton():
    """What a graph replays, without CUDA: the metadata is made once, at capture (every row
    padding, planned for max_model_len), the inputs are refilled later, and the Triton kernels
    (the interpreter here) read the buffers as device tensors. The seq_lens and block-table
    views must be dense: a column view made the first H200 run read wrong lengths."""
    torch.manual_seed(0)
    model = tiny_llama(seed=0, **dict(SMALL, hidden_size=128))
    runner = ModelRunner(
        model, num_blocks=16, block_size=4, compile=False, max_num_seqs=8, max_model_len=32,
        backend="triton",
    )  # fmt: skip
    runner.use_op = True  # the custom op, as the CUDA fast path runs it
    buf = runner.decode_buffers
    buf.fill(_EmptyPlan(), 4)
    captured = buf.metadata(4, max_seq_len=runner.max_model_len)
    assert captured.seq_lens.is_contiguous() and captured.block_table.stride(1) == 1
    decode = _prefill_three(runner)
    before = [c.clone() for c in runner.kv_caches]
    want = runner.execute(decode, np.arange(3))
    for c, b in zip(runner.kv_caches, before, strict=True):
        c.copy_(b)
    buf.fill(decode, 4)
    with torch.inference_mode():
        got = runner._decode_forward(4, captured)[:3]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _EagerGraphs(CudaGraphs):
    """CudaGraphs' protocol on the CPU: "capture" keeps the run and its capture-time metadata,
    "replay" refills the buffers and reruns with that metadata, as a graph's kernels would."""

    DEVICE_TYPE = "cpu"
    replays = 0

    def _begin(self):
        pass

    def _record(self, run, batch, meta):
        run(batch, meta)
        return run, batch, meta

    def _play(self, recorded):
        run, batch, meta = recorded
        self.replays += 1
        return run(batch, meta)

    def _end(self):
        pass


@needs_interpreter
def test_graph_protocol_on_triton_greedy_equals_eager():
    """The engine with every decode step replayed CudaGraphs' way (capture-time metadata,
    padded buckets, the Triton kernels under the interpreter) generates eager's tokens."""
    from kvcore.entrypoints.llm import LLM

    model, prompts, params, kw = _greedy_case()
    want = LLM(model, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, kernel_backend="triton", **kw)
    runner = llm.engine.runner
    runner.use_op = True  # the custom op, as on CUDA
    graphs = _EagerGraphs(runner.decode_buffers, graph_sizes(8))
    with torch.inference_mode():
        graphs.capture(runner._decode_forward, runner.max_model_len)
    runner.graphs = graphs
    got = llm.generate(prompts, params, use_tqdm=False)
    assert graphs.replays > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.all_blocks_free()


@pytest.mark.parametrize("field", ["seq_lens", "query_start_loc", "block_table"])
def test_triton_refuses_strided_metadata(field):
    import kvcore_kernels as kk
    from kvcore_kernels.errors import KernelConfigError

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    meta = kk.plan_attention(
        np.arange(3), np.array([3, 5]), np.array([[1, 2], [3, 4]]), 4, device=dev
    )
    good = getattr(meta, field)
    if field == "block_table":  # rows of stride 1 no more: a transposed copy's view
        strided = good.t().contiguous().t()
    else:  # every other element of a twice-as-long buffer
        strided = torch.zeros(2 * good.numel(), dtype=good.dtype, device=dev)[::2]
        strided.copy_(good)
    setattr(meta, field, strided)
    q = torch.randn(2, 2, 32, device=dev)
    cache = torch.zeros(8, 2, 4, 1, 32, device=dev)
    with pytest.raises(KernelConfigError, match="contiguous"):
        kk.paged_attention(q, cache, meta, scale=0.1, backend="triton")


# ---- on a GPU (skipped without CUDA): the same checks through real captured graphs ----------


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_greedy_equals_eager(compile):
    from kvcore.entrypoints.llm import LLM

    model, prompts, params, kw = _greedy_case("cuda")
    want = LLM(model, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, compile=compile, **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    assert runner.graphs.capture_seconds > 0
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.all_blocks_free()


@pytest.mark.cuda
def test_cuda_graph_replay_equals_plain_step_and_touches_no_block():
    model = tiny_llama(seed=0, **GPU).to("cuda")
    runner = ModelRunner(
        model, num_blocks=16, block_size=4, compile=False, max_num_seqs=8, max_model_len=32
    )
    assert runner.graphs is not None
    decode = _prefill_three(runner)
    before = [c.clone() for c in runner.kv_caches]
    got = runner.execute(decode, np.arange(3))  # replays the batch-4 graph
    torch.cuda.synchronize()
    after_graph = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before, strict=True):
        c.copy_(b)
    runner.graphs, graphs = None, runner.graphs
    want = runner.execute(decode, np.arange(3))  # the same step without a graph
    runner.graphs = graphs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g, p in zip(after_graph, runner.kv_caches, strict=True):
        torch.testing.assert_close(g, p, rtol=1e-5, atol=1e-5)  # null block included
