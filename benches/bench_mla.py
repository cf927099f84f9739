"""MLA benchmark: kvcore's paged latent cache vs transformers' generate on a tiny DeepSeek model.

Model: ``kvcore.models.mla.TINY_DEEPSEEK_CONFIG`` (DeepSeek-V3-shaped by default, ``--version v2``:
hidden 512, 6 layers of which 5 MoE (16 routed experts, top 2, one shared), 8 heads,
q_lora_rank 192, kv_lora_rank 128, qk_rope 32, qk_nope 64, v_head 64, vocab 32000, fp32, weights
seeded by ``--seed``; ``--kv-format fp8_e4m3``: FP8 latents with a per-block scale).
Workload: ``--batch`` (32) random prompts of ``--prompt-len`` (128) tokens (seeded),
``--new-tokens`` (64) greedy tokens each, EOS ignored.

* bytes per token: read from the engine's allocation (latent caches' bytes / slots), beside the
  same model caching per-head K and V (``heads * (qk_nope + qk_rope + v_head)`` values per layer).
* decode tokens/s at batch ``--batch``: kvcore times the steps after every request's prefill
  (one step) finished; transformers times ``generate`` with its dynamic cache on the same model
  object, ``--new-tokens`` minus 1 new token (the prefill), both in this run, one after the other.
  Equal-length prompts, so transformers pads nothing.
* greedy_equal_fraction: requests whose whole greedy continuation equals transformers' (the
  batched generate above).

    python benches/bench_mla.py --seed 0 [--threads 2] [--version v3]

Prints ``name: value unit`` lines.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see bench_e2e.py)

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from kvcore import _kvcore  # noqa: E402
from kvcore.entrypoints.llm import LLM  # noqa: E402
from kvcore.models.mla import tiny_deepseek  # noqa: E402
from kvcore.models.sizes import mha_equivalent_bytes_per_token  # noqa: E402
from kvcore.params import SamplingParams  # noqa: E402


def hf_generate_timed(model, prompts: torch.Tensor, new_tokens: int) -> tuple[list, float]:
    """transformers' generate (dynamic cache, SDPA) on the batch; (outputs, seconds)."""
    model.set_attn_implementation("sdpa")
    kw = dict(
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        max_new_tokens=new_tokens,
    )
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(prompts, **kw)
        seconds = time.perf_counter() - start
    return out[:, prompts.shape[1] :].tolist(), seconds


def kvcore_timed(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[list, float, int]:
    """Serve the batch; (outputs, seconds of the steps after prefill, tokens they produced)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = engine.add_requests(prompts, params)
    outs: dict[str, list[int]] = {}
    for o in engine.step():  # the prefill step: every prompt whole, first tokens sampled
        outs[o.request_id] = o.outputs[0].token_ids
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
        steps += 1
    seconds = time.perf_counter() - start
    return [outs[i] for i in ids], seconds, steps * len(prompts)


def prefill_forms(cfg, lengths: tuple[int, ...], dtype: torch.dtype) -> dict[str, float]:
    """ms of one layer's MLA op on one fresh prefill chunk, absorbed vs expanded vs auto."""
    import kvcore_kernels as kk
    from kvcore_kernels.mla import attention_torch as mla_torch

    h, r, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, bs = cfg.qk_nope_head_dim, cfg.v_head_dim, 16
    gen = torch.Generator().manual_seed(0)
    res = {}
    for n in lengths:
        blocks = -(-n // bs)
        cache = torch.randn(blocks + 1, bs, r + rope, generator=gen).to(dtype)
        meta = kk.plan_attention(
            np.array([0, n]), np.array([n]), np.arange(1, blocks + 1)[None], bs
        )
        args = dict(
            q_nope=torch.randn(n, h, nope, generator=gen).to(dtype),
            q_pe=torch.randn(n, h, rope, generator=gen).to(dtype),
            cache=cache,
            meta=meta,
            w_uk=torch.randn(h, nope, r, generator=gen).to(dtype) * r**-0.5,
            w_uv=torch.randn(h, v, r, generator=gen).to(dtype) * r**-0.5,
            scale=0.1,
        )
        for force in ("absorbed", "expanded", None):
            mla_torch.mla_attention_torch(**args, force=force)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                mla_torch.mla_attention_torch(**args, force=force)
                times.append(time.perf_counter() - start)
            res[f"prefill_{n}_{force or 'auto'}_ms"] = 1e3 * float(np.median(times))
    return res


def fp8_attention_error(cfg, seed: int) -> float:
    """Relative error (Frobenius) of one MLA op reading FP8 latents instead of fp32 ones: 8
    decodes over 120 cached tokens and a 64-token prefill, N(0, 1) latents, the model's dims."""
    import kvcore_kernels as kk

    h, r, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, bs = cfg.qk_nope_head_dim, cfg.v_head_dim, 16
    gen = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = [1] * 8 + [64], [121] * 8 + [64]
    need = [-(-n // bs) for n in seq_lens]
    table = np.zeros((len(need), max(need)), np.int64)
    ids = iter(range(1, 1 + sum(need)))
    for i, k in enumerate(need):
        table[i, :k] = [next(ids) for _ in range(k)]
    meta = kk.plan_attention(np.r_[0, np.cumsum(q_lens)], np.array(seq_lens), table, bs)
    plain = kk.allocate_latent_cache(1 + sum(need), bs, r, rope, torch.float32, "cpu")
    fp8 = kk.allocate_latent_fp8_cache(1 + sum(need), bs, r, rope, "cpu")
    for i, n in enumerate(seq_lens):
        pos = np.arange(n)
        slots = torch.from_numpy(table[i][pos // bs] * bs + pos % bs)
        lat = torch.randn(n, r + rope, generator=gen)
        for cache in (plain, fp8):
            kk.store_latent(lat[:, :r].contiguous(), lat[:, r:].contiguous(), cache, slots)
    t = meta.num_tokens
    args = dict(
        q_nope=torch.randn(t, h, nope, generator=gen),
        q_pe=torch.randn(t, h, rope, generator=gen),
        meta=meta,
        w_uk=torch.randn(h, nope, r, generator=gen) * r**-0.5,
        w_uv=torch.randn(h, v, r, generator=gen) * r**-0.5,
        scale=(nope + rope) ** -0.5,
    )
    a = kk.mla_attention(cache=plain, **args)
    b = kk.mla_attention(cache=fp8, **args)
    return float((a - b).norm() / a.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--version", default="v3", choices=["v2", "v3"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-format", default="auto", choices=["auto", "fp8_e4m3"], help="latent")
    p.add_argument("--no-prefill-forms", action="store_true", help="skip the prefill timings")
    args = p.parse_args()
    if _kvcore.DEBUG_BUILD:
        raise SystemExit("refusing to benchmark a debug build: pip install -e . (release profile)")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tiny_deepseek(args.version, seed=args.seed)
    cfg = model.config
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, cfg.vocab_size, (args.batch, args.prompt_len))
    bs = args.block_size
    per_seq_blocks = -(-(args.prompt_len + args.new_tokens) // bs)
    llm = LLM(
        model,
        block_size=bs,
        num_blocks=args.batch * per_seq_blocks + 8,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
        prefix_caching="off",
        kv_format=args.kv_format,
        seed=args.seed,
    )
    runner = llm.engine.runner
    # Bytes per token from the allocation: every latent cache's bytes over its token slots.
    slots = runner.num_blocks * bs
    mla_bytes = sum(c.untyped_storage().nbytes() for c in runner.kv_caches) / slots
    mha_bytes = mha_equivalent_bytes_per_token(cfg, model.dtype)
    # Warm-up both paths (first-call allocations), untimed.
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5] * 40, [6] * 70], warm, use_tqdm=False)
    hf_generate_timed(model, torch.tensor(prompts[:2]), 4)

    kv_out, kv_s, kv_tokens = kvcore_timed(llm, prompts.tolist(), args.new_tokens)
    assert llm.engine.all_blocks_free()
    t = torch.tensor(prompts)
    hf_out, hf_full = hf_generate_timed(model, t, args.new_tokens)
    _, hf_prefill = hf_generate_timed(model, t, 1)
    hf_tokens = args.batch * (args.new_tokens - 1)
    kv_rate = kv_tokens / kv_s
    hf_rate = hf_tokens / max(1e-9, hf_full - hf_prefill)
    equal = sum(a == b for a, b in zip(kv_out, hf_out, strict=True)) / args.batch
    print(
        f"model: tiny deepseek_{args.version} (seed {args.seed}, "
        f"{torch.get_num_threads()} threads, latent {args.kv_format})"
    )
    print(f"bytes_per_token_mla: {mla_bytes:.1f} bytes")
    print(f"bytes_per_token_mha_equivalent: {mha_bytes:.1f} bytes")
    print(f"bytes_ratio_mha_over_mla: {mha_bytes / mla_bytes:.2f} x")
    print(f"greedy_equal_fraction: {equal:.4f} fraction")
    print(f"kvcore_tok_per_s: {kv_rate:.1f} tok/s")
    print(f"hf_tok_per_s: {hf_rate:.1f} tok/s")
    print(f"ratio_vs_hf: {kv_rate / hf_rate:.2f} x")
    print(f"kvcore_decode_s: {kv_s:.2f} s")
    print(f"hf_decode_s: {hf_full - hf_prefill:.2f} s")
    print(f"fp8_latent_attention_rel_err: {fp8_attention_error(cfg, args.seed):.4f} fraction")
    if args.no_prefill_forms:
        return
    # Which form pays for a long prefill chunk (one layer's MLA op, median of 7).
    for name, ms in prefill_forms(cfg, (32, 128, 512, 2048), model.dtype).items():
        print(f"{name}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
