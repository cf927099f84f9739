"""KV blocks with and without retention: peak blocks per conversation and concurrent
conversations admitted in one fixed KV budget, measured on the Rust scheduler (docs/retention.md).

Block counts are the scheduler's business, so the forward is not run: the engine's decision
(which window to release behind, from the model's config, as ``LLMEngine`` makes it) drives a
``kvcore.Scheduler`` stepped with a constant sampled token. ``--model`` is a built-in shape
(``tiny-mistral``: every layer windowed; ``tiny-gemma3``: Gemma 3 270M's layout, 18 layers,
window 512, every 6th global) or anything ``kvcore.models.loader.load_model`` loads (its config is
read). Prints ``name: value unit`` lines; ``--seeds`` jitters the lengths (+-10%) per seed and
reports mean and spread.

    python benches/bench_retention_memory.py --model tiny-mistral --context 16384
    python benches/bench_retention_memory.py --model tiny-gemma3 --retention sink:4+window:1020
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from kvcore import _kvcore
from kvcore.retention.release import exact_release_window, kv_groups, model_windows
from kvcore.retention.spec import parse_retention


def model_config(name: str):
    import transformers as tf

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=256)
    if name == "tiny-mistral":
        return tf.MistralConfig(
            **small, num_hidden_layers=4, num_key_value_heads=2, sliding_window=512
        )
    if name == "tiny-gemma3":
        return tf.Gemma3TextConfig(
            **small,
            num_hidden_layers=18,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            max_position_embeddings=32768,
        )
    from kvcore.models.loader import load_model

    return load_model(name)[0].config


def run(window, lengths, num_blocks, block_size, budget, chunk, retention=(0, 0), groups=()):
    """Steps every conversation to its end; returns (peak blocks per conversation (max), most
    conversations running at once, preemptions, steps, mean decode rows per step: how many
    conversations really advance together)."""
    s = _kvcore.Scheduler(
        num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=chunk,
        max_model_len=max(p + o for p, o in lengths) + 1,
        prefix_mode="off",
        watermark=0.0,
        sliding_window=window,
        group_windows=list(groups),
    )
    prompts = [np.arange(p, dtype=np.int64) % 50_000 + 10 + i for i, (p, _) in enumerate(lengths)]
    s.add_requests(
        np.arange(len(lengths), dtype=np.int64),
        np.concatenate(prompts),
        np.cumsum([0] + [len(p) for p in prompts], dtype=np.int64),
        np.asarray([o for _, o in lengths], np.int64),
        ignore_eos=True,
        retention_sink=retention[0],
        retention_window=retention[1],
    )
    peak, running, steps, decodes = 0, 0, 0, 0
    while s.has_unfinished():
        plan = s.schedule()
        running = max(running, s.stats().num_running)
        decodes += plan.num_decode
        fin = s.update(plan.step_id, np.full(len(plan.logits_indices), 7, np.int64))
        if fin.num_finished:
            peak = max(peak, int(fin.peak_blocks.max()))
        steps += 1
    st = s.stats()
    assert st.num_free_blocks == num_blocks - 1, "blocks did not all come back"
    return peak, running, st.num_preemptions, steps, decodes / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-mistral")
    ap.add_argument("--context", type=int, default=16384, help="tokens per conversation")
    ap.add_argument("--output", type=int, default=512, help="of which generated")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--budget-conversations", type=float, default=4.0,
                    help="KV budget, in full-attention conversations")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="per-sequence cap (0: none)")
    ap.add_argument("--retention", default=None, help="a lossy policy to add (sink:S+window:W)")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    cfg = model_config(a.model)
    windows = model_windows(cfg)
    w = exact_release_window(cfg, True, ["auto"] * len(windows))
    groups = kv_groups(windows)
    n_local = sum(x is not None for x in windows)
    num_layers = len(windows)
    print(f"layers: {num_layers} layers")
    print(f"local_layers: {n_local} layers")
    print(f"release_window: {w} tokens")
    bs = a.block_size
    full_blocks = -(-(a.context - 1) // bs)
    num_blocks = int(a.budget_conversations * (full_blocks + 1)) + 1
    print(f"kv_budget: {num_blocks - 1} blocks of {num_layers} layers")
    # mode -> (window, retention blocks, extra group windows, layers per block)
    modes = {"full": (0, (0, 0), (), num_layers), "release": (w, (0, 0), (), num_layers)}
    if groups is not None:  # hybrid: KV cache groups, a block holds one group's layers
        print(f"kv_groups: {len(groups.windows)} groups of {groups.size} layers")
        modes["release"] = (0, (0, 0), groups.windows[1:], groups.size)
    if a.retention:
        b = parse_retention(a.retention).blocks(bs)
        modes[parse_retention(a.retention).metric_name] = (w, (b.sink, b.window), (), num_layers)
    res: dict[str, list[tuple[int, int, int, int, float]]] = {m: [] for m in modes}
    for seed in range(a.seeds):
        rng = np.random.default_rng(seed)
        lengths = []
        for _ in range(a.conversations):
            total = int(a.context * rng.uniform(0.9, 1.0))
            out = int(a.output * rng.uniform(0.9, 1.1))
            lengths.append((total - out, out))
        for m, (win, ret, gw, per_block) in modes.items():
            # The same bytes: a block of fewer layers gives more blocks.
            nb = (num_blocks - 1) * num_layers // per_block + 1
            r = run(win, lengths, nb, bs, a.batch_tokens, a.prefill_chunk, ret, gw)
            res[m].append((r[0] * per_block / num_layers, *r[1:]))

    def show(name, values, unit):
        sd = statistics.pstdev(values) if len(values) > 1 else 0.0
        print(f"{name}: {statistics.mean(values):.2f} {unit} (sd {sd:.2f}, n={len(values)})")

    for m, rows in res.items():
        show(f"peak_blocks_per_seq_{m}", [r[0] for r in rows], f"blocks of {num_layers} layers")
        show(f"max_concurrent_{m}", [r[1] for r in rows], "conversations")
        show(f"preemptions_{m}", [r[2] for r in rows], "preemptions")
        show(f"steps_{m}", [r[3] for r in rows], "steps")
        show(f"mean_decode_batch_{m}", [r[4] for r in rows], "conversations")
        if m != "full":
            show(
                f"peak_blocks_ratio_{m}",
                [r[0] / f[0] for r, f in zip(rows, res["full"], strict=True)],
                "x of full",
            )
            show(
                f"concurrency_ratio_{m}",
                [r[4] / f[4] for r, f in zip(rows, res["full"], strict=True)],
                "x of full (mean decode batch)",
            )


if __name__ == "__main__":
    main()
