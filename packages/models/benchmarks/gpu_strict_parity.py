"""Strict numerics on a GPU: train/decode parity there, CPU-vs-GPU bits, and strict/fast speed.

Strict kernels use only IEEE-exact or correctly rounded elementwise ops (products, adds in a
fixed pairwise tree, division, sqrt, exponent-bit arithmetic), each in its own kernel so no
FMA contraction can happen. If CUDA rounds those ops like the CPU does, strict logprobs are
bit-identical across devices too; this script measures whether they are, and reports the
price of strict mode on the GPU. Self-contained: needs torch (+CUDA) only. Run from the repo root:

    PYTHONPATH=packages/interface/src:packages/models/src python packages/models/benchmarks/gpu_strict_parity.py
    # dry run on CPU:  ... gpu_strict_parity.py --device cpu --reps 1

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from posttrain.models import (
    DecoderModel,
    ModelConfig,
    Numerics,
    build_model,
    decoded_logprobs,
    packed_logprobs,
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def segments_for(
    cfg: ModelConfig, seed: int, n: int, max_len: int
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lens = [rng.randint(2, max_len) for _ in range(n)]
    segs = [[rng.randrange(cfg.vocab_size) for _ in range(m)] for m in lens]
    return segs, [rng.randint(1, m - 1) for m in lens]


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float | int | bool]:
    return {
        "bit_identical": bool(torch.equal(a, b)),
        "mismatched_tokens": int((a != b).sum()),
        "tokens": int(a.numel()),
        "max_abs_diff": float((a - b).abs().max()),
    }


def throughput(
    model: DecoderModel, device: torch.device, tokens: int, seg_len: int, rows: int, steps: int
) -> dict[str, float]:
    ids = torch.randint(0, model.config.vocab_size, (tokens,))
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        model.forward_logprobs(ids, [seg_len] * (tokens // seg_len))
    sync(device)
    train = tokens / (time.perf_counter() - t)
    cache = model.new_kv_cache(rows)
    for r in range(rows):
        model.prefill(cache, r, [1] * 16)
    toks = [2] * rows
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        toks = model.decode_step(cache, list(range(rows)), toks).logprobs.argmax(-1).tolist()
    sync(device)
    return {"train_forward_tok_s": train, "decode_tok_s": rows * steps / (time.perf_counter() - t)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    report: dict[str, object] = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32

    parity = {}
    for name, cfg in {
        "tiny_fp32": ModelConfig.tiny(max_position_embeddings=64),
        "tiny_bf16_params": ModelConfig.tiny(max_position_embeddings=64, torch_dtype="bfloat16"),
    }.items():
        cpu_model = build_model(cfg, 0)
        segs, prompts = segments_for(cfg, 0, 6, 60)
        cpu_train = packed_logprobs(cpu_model, segs)
        dev_model = build_model(cfg, 0).to(device)
        dev_train = packed_logprobs(dev_model, segs)
        dev_decode = decoded_logprobs(dev_model, segs, prompts)
        dev_model.numerics = Numerics.FAST
        dev_fast = packed_logprobs(dev_model, segs)
        parity[name] = {
            "device_train_vs_device_decode": compare(dev_train, dev_decode),
            "cpu_train_vs_device_train": compare(cpu_train, dev_train),
            "device_fast_vs_device_strict": compare(dev_fast, dev_train),
        }
    report["parity"] = parity

    small = ModelConfig.tiny(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=8,
        max_position_embeddings=256,
    )
    models = {n: build_model(small, 0, numerics=n).to(device) for n in Numerics}
    tokens, seg_len = (2048, 256) if device.type == "cuda" else (256, 128)
    samples: dict[str, dict[str, list[float]]] = {n.value: {} for n in Numerics}
    for n in Numerics:
        throughput(models[n], device, tokens, seg_len, 8, 4)  # warm-up
    for _ in range(args.reps):
        for n in Numerics:
            for k, v in throughput(models[n], device, tokens, seg_len, 8, 16).items():
                samples[n.value].setdefault(k, []).append(v)
    speed = {
        n: {k: round(statistics.median(v), 1) for k, v in d.items()} for n, d in samples.items()
    }
    speed["strict_over_fast"] = {
        k: round(speed["strict"][k] / speed["fast"][k], 4) for k in speed["strict"]
    }
    report["speed_small_config"] = speed
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
