"""KV capacity versus training cost: one short forward+backward at capacity 40,960 and at 256.

A Qwen3-shaped dense model (``family="qwen3"``) is built twice with the same weights: once
with ``max_position_embeddings`` 40,960 (Qwen3's, the default KV capacity) and once with 256.
A packed training forward+backward over ``--segments`` sequences of ``--length`` tokens runs
on each, interleaved, ``--reps`` times; the medians and their ratio are printed as JSON (the
claim: within 1.2x). Strict numerics by default. Run from the repo root:

    uv run python packages/models/benchmarks/bench_kv_capacity.py [--device cuda] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from posttrain.models import DecoderModel, ModelConfig, Numerics, build_model

SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "moe_intermediate_size": 0,
    "num_experts": 0,
    "num_experts_per_tok": 1,
    "family": "qwen3",
    "rope_theta": 1000000.0,
}


def step(model: DecoderModel, ids: torch.Tensor, lengths: list[int]) -> float:
    """Seconds of one forward+backward (gradients cleared first)."""
    model.zero_grad(set_to_none=True)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model.forward_logprobs(ids, lengths).sum().backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--numerics", choices=["strict", "fast"], default="strict")
    p.add_argument("--segments", type=int, default=2)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    numerics = Numerics(a.numerics)
    models = {
        cap: build_model(
            ModelConfig(**SHAPE, max_position_embeddings=cap),
            seed=0,
            numerics=numerics,
            device=a.device,
        )
        for cap in (40960, 256)
    }
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (a.segments * a.length,), generator=gen)
    ids = ids.to(a.device)
    lengths = [a.length] * a.segments
    times: dict[int, list[float]] = {cap: [] for cap in models}
    for model in models.values():  # warm-up
        step(model, ids, lengths)
    for _ in range(a.reps):
        for cap, model in models.items():
            times[cap].append(step(model, ids, lengths))
    median = {cap: statistics.median(t) for cap, t in times.items()}
    print(
        json.dumps(
            {
                "device": a.device,
                "numerics": a.numerics,
                "tokens": a.segments * a.length,
                "seconds_at_capacity_40960": round(median[40960], 4),
                "seconds_at_capacity_256": round(median[256], 4),
                "ratio": round(median[40960] / median[256], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
