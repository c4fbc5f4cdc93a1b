"""One GRPO training step on a GPU: full and LoRA, FSDP on 1 GPU and HSDP on 2, strict vs fast.

A random-init ``posttrain.models`` Dense/MoE decoder of a few hundred million parameters
(``--size base``: hidden 1024, 8 layers, 2 dense + 6 MoE with 8 experts top-2, vocab 32000,
about 258M parameters) is sharded with ``fsdp-mesh`` exactly as the GRPO trainer shards it
(``posttrain.grpo.trainer``: root-only FSDP2 unit, fp32 parameters and reductions, LoRA factors
outside FSDP and reduced by ``lora-core``), and ``train_step`` runs on synthetic samples: the
forward, the GRPO objective, backward, gradient reduction, clipping and one AdamW step.

Reported per (mode, numerics, world size): tokens/s over the measured steps (median), peak
memory (``torch.cuda.max_memory_allocated``, largest over ranks), and that the trainer's
logprobs of the tokens equal the reference logprobs fed in as the rollout's (strict: 0 diff).
Strict numerics reduce every dot product in a fixed tree: far slower, so strict runs use a
small batch (``--strict-tokens``) and the fast run is also measured at that batch for the ratio.

Needs torch (+CUDA) and the repo's src paths only. From the repo root:

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python packages/grpo/benchmarks/gpu_train_step.py
    # dry run here:  ... gpu_train_step.py --device cpu --size tiny --reps 1

Prints one JSON object per configuration, then a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.trainer import TrainSample, shard_policy, train_step
from posttrain.interface.processes import run_workers
from posttrain.models import ModelConfig, Numerics, build_model

SIZES = {
    "tiny": {"vocab_size": 101, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "moe_intermediate_size": 32, "num_experts": 4,
             "num_experts_per_tok": 2, "mlp_only_layers": (0,), "max_position_embeddings": 64},
    "base": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
             "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 64, "moe_intermediate_size": 1024, "num_experts": 8,
             "num_experts_per_tok": 2, "mlp_only_layers": (0, 1), "max_position_embeddings": 512},
}  # fmt: skip
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _samples(cfg: ModelConfig, tokens: int, seq_len: int, rank: int, world: int,
             model: Any) -> list[TrainSample]:  # fmt: skip
    """This rank's share of ``tokens`` tokens in sequences of ``seq_len`` (half prompt)."""
    gen = torch.Generator().manual_seed(1234)
    n = max(world, tokens // seq_len)
    prompt = seq_len // 2
    seqs = [torch.randint(0, cfg.vocab_size, (seq_len,), generator=gen).tolist() for _ in range(n)]
    mine = seqs[rank::world]
    device = model.embedding.device
    with torch.no_grad():  # the "engine" logprobs: the same model, before the step
        ref = [model.forward_logits(torch.tensor(s, device=device), [seq_len]) for s in mine]
    out = []
    for s, logits in zip(mine, ref, strict=True):
        lp = model.ops.log_softmax(logits[prompt - 1 : seq_len - 1])
        picked = lp.gather(1, torch.tensor(s[prompt:], device=device)[:, None])[:, 0]
        out.append(TrainSample(tokens=s, prompt_len=prompt, loss_mask=[1] * (seq_len - prompt),
                               rollout_logprobs=picked.cpu().tolist(),
                               advantages=[1.0 if len(out) % 2 else -1.0] * (seq_len - prompt)))  # fmt: skip
    return out


def measure(rank: int, world: int, args: argparse.Namespace, train: str, numerics: str,
            tokens: int) -> dict[str, Any]:  # fmt: skip
    device = torch.device(args.device, rank if args.device == "cuda" else 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    mcfg = ModelConfig(**SIZES[args.size])  # type: ignore[arg-type]
    model = build_model(mcfg, seed=0, numerics=Numerics(numerics)).to(device)
    params = sum(p.numel() for p in model.parameters())  # before LoRA factors and sharding
    gcfg = GrpoConfig(train=train, replicate=world if args.hsdp else 1,  # type: ignore[arg-type]
                      shard=1 if args.hsdp else world, lr=1e-5, lora_targets=TARGETS,
                      lora_r=16, lora_alpha=32.0)  # fmt: skip
    samples = _samples(mcfg, tokens, args.seq_len, rank, world, model)
    policy = shard_policy(model, gcfg, device=device)  # what the GRPO trainer builds, on device
    total = world * len(samples) * (args.seq_len - args.seq_len // 2)
    seconds, diffs = [], []
    for rep in range(args.reps + 1):
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        metrics = train_step(policy, samples, gcfg, global_batch_size=world * len(samples),
                             global_token_count=total)  # fmt: skip
        if args.device == "cuda":
            torch.cuda.synchronize(device)
        if rep == 0:
            diffs.append(metrics["train_rollout_logprob_max_abs_diff"])  # before any update
        else:
            seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if args.device == "cuda" else 0
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    return {
        "train": train, "numerics": numerics, "world": world, "hsdp": bool(args.hsdp),
        "params": params if rank == 0 else None,
        "tokens_per_step": world * len(samples) * args.seq_len,
        "tokens_per_s": world * len(samples) * args.seq_len / statistics.median(seconds),
        "step_s_median": statistics.median(seconds),
        "peak_memory_gib": max(p or 0 for p in peaks) / 2**30,
        "first_step_max_abs_logprob_diff": diffs[0],
    }  # fmt: skip


def _rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    out = []
    for train in ("full", "lora"):
        for numerics, tokens in (("fast", args.tokens), ("fast", args.strict_tokens),
                                 ("strict", args.strict_tokens)):  # fmt: skip
            if numerics == "strict" and args.skip_strict:
                continue
            out.append(measure(rank, world, args, train, numerics, tokens))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="base")
    parser.add_argument("--gpus", type=int, nargs="+", default=None,
                        help="world sizes to run (default: 1, and 2 where 2 GPUs exist)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per step (fast)")
    parser.add_argument("--strict-tokens", type=int, default=256, help="tokens per step (strict)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-strict", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=1200.0)
    args = parser.parse_args()
    if args.device == "cpu":
        args.seq_len = min(args.seq_len, SIZES[args.size]["max_position_embeddings"])  # type: ignore[type-var]
    available = torch.cuda.device_count() if args.device == "cuda" else 2
    worlds = args.gpus or ([1, 2] if available >= 2 else [1])
    results = []
    for world in worlds:
        if world > available:
            print(json.dumps({"world": world, "skipped": f"only {available} device(s)"}))
            continue
        for hsdp in [False, True] if world > 1 else [False]:
            run_args = replace_ns(args, hsdp=hsdp)
            backend = "nccl" if args.device == "cuda" else "gloo"
            per_rank = run_workers(_rank, world, args=(run_args,), backend=backend,
                                   timeout_s=args.timeout_s, start_method="spawn",
                                   threads_per_rank=None)  # fmt: skip
            for row in per_rank[0]:
                print(json.dumps(row), flush=True)
                results.append(row)
    strict = {(r["train"], r["world"], r["hsdp"]): r for r in results if r["numerics"] == "strict"}
    ratios = {
        f"{k[0]}_w{k[1]}{'_hsdp' if k[2] else ''}": round(v["tokens_per_s"] / f["tokens_per_s"], 4)
        for k, v in strict.items()
        for f in results
        if f["numerics"] == "fast" and (f["train"], f["world"], f["hsdp"]) == k
        and f["tokens_per_step"] == v["tokens_per_step"]
    }  # fmt: skip
    print(json.dumps({"summary": "strict/fast tokens per second at equal batch", **ratios}))
    sys.stdout.flush()
    os._exit(0)  # NCCL teardown can hang on some drivers; every result is printed


def replace_ns(ns: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), **changes})


if __name__ == "__main__":
    main()
