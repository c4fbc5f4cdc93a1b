"""Strict versus fast numerics: tokens/s of the packed training forward and of KV-cache decode.

Both modes run on the same weights, interleaved, ``--reps`` times each; the medians and
their ratio (the price of parity) are printed as JSON. Run from the repo root:

    uv run python packages/models/benchmarks/bench_strict_vs_fast.py [--threads 1] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from posttrain.models import DecoderModel, ModelConfig, Numerics, build_model

SIZES = {
    "tiny": ModelConfig.tiny(max_position_embeddings=64),
    "small": ModelConfig.tiny(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    ),
}


def train_forward(model: DecoderModel, segments: int, length: int, backward: bool) -> float:
    ids = torch.randint(0, model.config.vocab_size, (segments * length,))
    start = time.perf_counter()
    if backward:
        model.zero_grad(set_to_none=True)
        model.forward_logprobs(ids, [length] * segments).sum().backward()
    else:
        with torch.no_grad():
            model.forward_logprobs(ids, [length] * segments)
    return segments * length / (time.perf_counter() - start)


def decode(model: DecoderModel, rows: int, prompt: int, steps: int) -> float:
    cache = model.new_kv_cache(rows)
    for r in range(rows):
        model.prefill(cache, r, torch.randint(0, model.config.vocab_size, (prompt,)).tolist())
    toks = [1] * rows
    start = time.perf_counter()
    for _ in range(steps):
        step = model.decode_step(cache, list(range(rows)), toks)
        toks = step.logprobs.argmax(-1).tolist()
    return rows * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = SIZES[args.size]
    args.length = min(args.length, cfg.max_position_embeddings)
    args.prompt = min(args.prompt, cfg.max_position_embeddings - args.steps - 1)
    models = {n: build_model(cfg, 0, numerics=n) for n in Numerics}
    cases: dict[str, Callable[[DecoderModel], float]] = {
        "train_forward": lambda m: train_forward(m, args.segments, args.length, False),
        "train_forward_backward": lambda m: train_forward(m, args.segments, args.length, True),
        "decode": lambda m: decode(m, args.rows, args.prompt, args.steps),
    }
    results: dict[str, dict[str, float]] = {}
    for case, fn in cases.items():
        samples: dict[str, list[float]] = {n.value: [] for n in Numerics}
        for n in Numerics:  # warm-up
            fn(models[n])
        for _ in range(args.reps):
            for n in Numerics:  # interleaved
                samples[n.value].append(fn(models[n]))
        med = {k: statistics.median(v) for k, v in samples.items()}
        results[case] = {
            "strict_tokens_per_s": round(med["strict"], 1),
            "fast_tokens_per_s": round(med["fast"], 1),
            "strict_over_fast": round(med["strict"] / med["fast"], 4),
        }
    print(
        json.dumps(
            {
                "size": args.size,
                "config": {
                    k: getattr(cfg, k)
                    for k in (
                        "hidden_size",
                        "num_hidden_layers",
                        "num_experts",
                        "vocab_size",
                        "max_position_embeddings",
                    )
                },
                "threads": args.threads,
                "reps": args.reps,
                "train_tokens": args.segments * args.length,
                "decode_rows": args.rows,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
