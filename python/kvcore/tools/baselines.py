"""transformers peers for the same workload: ``generate`` in static batches and transformers' own
continuous batching. Used by ``kvcore run --compare`` and ``benches/bench_e2e.py``.

All requests arrive at time 0. Greedy, EOS ignored, each request gets exactly its own
``max_tokens`` (a static batch runs to its longest request; the extra tokens of shorter ones are
waste and are not counted). Timings: a request's tokens arrive when its batch's step ends (a
logits processor stamps every step), so time to first token includes waiting for earlier batches.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PeerResult:
    """Outputs and timings of one peer run."""

    name: str
    wall_s: float
    outputs: list[list[int]]
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        """Useful output tokens (each request's own max_tokens)."""
        return sum(len(o) for o in self.outputs)

    @property
    def tok_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.wall_s


@contextmanager
def _plain_attention(model: Any) -> Iterator[None]:
    """Run the peer on transformers' own SDPA attention (not kvcore's), then restore."""
    before = model.config._attn_implementation
    if before not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)


class _StepClock:
    """A logits processor that records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def hf_generate(
    model: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    batch_size: int = 1,
    pad_token_id: int = 0,
) -> PeerResult:
    """transformers ``generate`` over static, left-padded batches of ``batch_size`` in order."""
    from transformers import LogitsProcessorList

    with _plain_attention(model):
        return _hf_generate(
            model, prompts, max_tokens, batch_size, pad_token_id, LogitsProcessorList
        )


def _hf_generate(
    model: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    batch_size: int,
    pad_token_id: int,
    processor_list: Any,
) -> PeerResult:
    outputs: list[list[int]] = []
    ttft: list[float] = []
    itl: list[float] = []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, lens = prompts[b : b + batch_size], max_tokens[b : b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        clock = _StepClock()
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=max(lens),
            eos_token_id=None,
            pad_token_id=pad_token_id,
            logits_processor=processor_list([clock]),
        )
        for i, n in enumerate(lens):
            outputs.append(out[i, width : width + n].tolist())
            ttft.append(clock.times[0] - start)
            itl.extend(b2 - a for a, b2 in zip(clock.times[: n - 1], clock.times[1:n], strict=True))
    return PeerResult(f"hf_generate_b{batch_size}", time.perf_counter() - start, outputs, ttft, itl)


@torch.inference_mode()
def hf_continuous(
    model: Any, prompts: list[list[int]], max_tokens: list[int], max_requests_per_batch: int | None
) -> PeerResult:
    """transformers' own continuous batching (``init_continuous_batching``), default settings
    except ``max_requests_per_batch``. A one-token warm-up request runs before the clock starts."""
    with _plain_attention(model):
        return _hf_continuous(model, prompts, max_tokens, max_requests_per_batch)


def _hf_continuous(
    model: Any, prompts: list[list[int]], max_tokens: list[int], max_requests_per_batch: int | None
) -> PeerResult:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), pad_token_id=0)
    cfg = ContinuousBatchingConfig(max_requests_per_batch=max_requests_per_batch)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    try:
        manager.add_request(prompts[0][:8], max_new_tokens=2, eos_token_id=-1)
        while (r := manager.get_result(timeout=600)) is None or not r.is_finished():
            pass
        start = time.perf_counter()
        ids = [
            manager.add_request(p, max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=600)
            if r is None:
                raise RuntimeError("transformers continuous batching stopped without results")
            if r.is_finished():
                results[r.request_id] = r
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        model.destroy_cached_continuous_batching_manager()
    outputs: list[list[int]] = []
    ttft: list[float] = []
    itl: list[float] = []
    for rid in ids:
        r = results[rid]
        if r.error is not None:
            raise RuntimeError(f"transformers continuous batching failed: {r.error}")
        outputs.append(list(r.generated_tokens))
        stamps = r.timestamps or []
        if stamps:
            ttft.append(stamps[0] - start)
            itl.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    name = f"hf_cb_{max_requests_per_batch or 'default'}"
    return PeerResult(name, wall, outputs, ttft, itl)
