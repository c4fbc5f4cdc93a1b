"""The trainer's strict CPU train step, autograd's own backward vs the strict kernels' backwards.

What the default ``posttrain grpo`` trains, without the rest of the stack: the recipe's policy
(``recipe.prepare``: the cached checkpoint), LoRA on the recipe's targets, strict numerics,
FSDP over ``--world`` gloo ranks (2, as ``posttrain grpo`` runs) at one torch thread each,
and per step 64 samples (8 prompts x 8 samples: the recipe's chat prompts, up to 4 response
tokens) split over the ranks. ``train_step`` is the trainer's own: forward, GRPO loss,
backward, gradient reduction, clipping, AdamW.

Two policies are built from the same checkpoint on every rank and stepped interleaved, the
same samples each step:

* **autograd**: the strict kernels' forward ops differentiated by autograd op by op (the
  backward before issue 38: ``posttrain.models._ops._CUSTOM_BACKWARD = False``, for this
  benchmark only);
* **custom**: the strict kernels' own backwards (``_StrictLinear``: BLAS matmuls,
  ``_ProductTreeSum``: einsum, ``_TreeSum``, ``_ExpStrict``).

The two share the forward bit for bit and their gradients agree to fp32 rounding, not bit for
bit. The script checks that the first step's forward metrics (every metric but
``grad_norm``) are equal, and that the first step's trainer logprobs of the response tokens
equal the strict decode's (``extend`` on a KV cache, the engine's path) to the bit:
``train_rollout_logprob_max_abs_diff`` 0; it reports the largest relative difference of each
metric over the steps and of the trainable parameters after the last one. Reported: the
median step time of each (rank 0's wall and thread CPU seconds), with the load average before
and after. Command::

    uv run python packages/grpo/benchmarks/bench_strict_train_step.py --steps 10
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.recipe import RECIPE, cache_dir, prepare
from posttrain.grpo.rewards import build_task
from posttrain.grpo.trainer import Policy, TrainSample, shard_policy, train_step
from posttrain.interface.processes import run_workers
from posttrain.models import DecoderModel, Numerics, _ops, build_tokenizer, load_pretrained

PATHS = ("autograd", "custom")


SAMPLES_PER_PROMPT = int(RECIPE["samples_per_prompt"])
"""Samples of one prompt in a step (the recipe's group size)."""


def step_samples(model: DecoderModel, step: int, count: int) -> list[TrainSample]:
    """``count`` samples of step ``step``: groups of ``SAMPLES_PER_PROMPT`` consecutive samples
    of one recipe prompt (as a GRPO step has them), random 1-4 token responses, their rollout
    logprobs from the strict decode of ``model`` (the policy before any update)."""
    tok = build_tokenizer()
    prompts = build_task("addition", lambda ids: "").prompts
    rng = random.Random(step)
    out = []
    for g in range(count):
        if g % SAMPLES_PER_PROMPT == 0:
            p = prompts[rng.randrange(len(prompts))]
        text = tok.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
        ids = list(tok.encode(str(text), add_special_tokens=False))
        resp = [rng.randrange(4, model.config.vocab_size) for _ in range(rng.randint(1, 4))]
        cache = model.new_kv_cache(1)
        first = model.prefill(cache, 0, ids).logprobs[-1]
        lps = [float(first[resp[0]])]
        for prev, nxt in itertools.pairwise(resp):
            lps.append(float(model.decode_step(cache, [0], [prev]).logprobs[0, nxt]))
        adv = 1.0 if g % 2 else -1.0
        out.append(TrainSample(tokens=ids + resp, prompt_len=len(ids), loss_mask=[1] * len(resp),
                               rollout_logprobs=lps, advantages=[adv] * len(resp)))  # fmt: skip
    return out


def _policy(path: str, cfg: GrpoConfig) -> Policy:
    return shard_policy(
        load_pretrained(path, numerics=Numerics.STRICT), cfg, device=torch.device("cpu")
    )


def recipe_config(train: str, world: int, path: str) -> GrpoConfig:
    """The trainer settings of the default run (``train``: ``lora`` or ``full``), sharded
    over ``world`` ranks, for the policy at ``path``."""
    return GrpoConfig(
        train=train, replicate=1, shard=world, lr=RECIPE["full_lr" if train == "full"
        else "lr"], lora_targets=RECIPE["lora_targets"], lora_r=RECIPE["lora_r"],
        lora_alpha=RECIPE["lora_alpha"], max_grad_norm=RECIPE["max_grad_norm"], model_path=path,
    )  # fmt: skip


def recipe_steps(path: str, steps: int, samples: int) -> list[list[TrainSample]]:
    """``steps`` steps of ``step_samples`` (``samples`` each) from the policy at ``path``."""
    reference = load_pretrained(path, numerics=Numerics.STRICT)
    with torch.no_grad():
        return [step_samples(reference, s, samples) for s in range(steps)]


def _rank(rank: int, world: int, args: argparse.Namespace, path: str) -> dict[str, Any]:
    cfg = recipe_config(args.train, world, path)
    steps = recipe_steps(path, args.steps, args.samples)
    policies = {name: _policy(path, cfg) for name in PATHS}
    wall: dict[str, list[float]] = {name: [] for name in PATHS}
    cpu: dict[str, list[float]] = {name: [] for name in PATHS}
    metrics: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
    for s, samples in enumerate(steps):
        tokens = sum(x.response_len for x in samples)
        mine = samples[rank::world]
        for name in PATHS if s % 2 else PATHS[::-1]:  # alternate which path goes first
            _ops._CUSTOM_BACKWARD = name == "custom"
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            m = train_step(policies[name], mine, cfg, global_batch_size=len(samples),
                           global_token_count=tokens)  # fmt: skip
            c1, t1 = time.thread_time(), time.perf_counter()
            metrics[name].append(m)
            if s >= args.warmup:
                wall[name].append(t1 - t0)
                cpu[name].append(c1 - c0)
    _ops._CUSTOM_BACKWARD = True

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).double()

    pairs = list(zip(policies["autograd"].trainable(), policies["custom"].trainable(),
                     strict=True))  # fmt: skip
    params_rel = max(
        float((full(b) - full(a)).norm() / max(float(full(a).norm()), 1e-30)) for a, b in pairs
    )
    first = metrics["autograd"][0]
    diff = "train_rollout_logprob_max_abs_diff"
    return {
        "same_forward": all(
            metrics["custom"][0][k] == v for k, v in first.items() if k != "grad_norm"
        ),
        "metrics_max_rel_diff": {
            k: max(
                abs(c[k] - a[k]) / max(abs(a[k]), 1e-30)
                for a, c in zip(metrics["autograd"], metrics["custom"], strict=True)
            )
            for k in first
        },
        "params_max_rel_l2": params_rel,
        "first_step_max_abs_diff": {n: metrics[n][0][diff] for n in PATHS},
        "grad_norms": [m["grad_norm"] for m in metrics["custom"]],
        "wall_s": wall,
        "cpu_s": cpu,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (all ranks)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--train", choices=("lora", "full"), default="lora")
    parser.add_argument("--seed", type=int, default=0, help="the recipe's seed")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    path = prepare(cache_dir(), args.seed)["policy"]
    load_before = os.getloadavg()
    per_rank = run_workers(_rank, args.world, args=(args, path), timeout_s=1800.0)
    load_after = os.getloadavg()
    r0 = per_rank[0]
    medians = {n: {"wall_s": round(statistics.median(r0["wall_s"][n]), 4),
                   "cpu_s": round(statistics.median(r0["cpu_s"][n]), 4)} for n in PATHS}  # fmt: skip
    result = {
        "train": args.train,
        "world": args.world,
        "samples": args.samples,
        "steps": args.steps,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
        "step_median": medians,
        "speedup_wall": round(medians["autograd"]["wall_s"] / medians["custom"]["wall_s"], 2),
        "first_step_forward_equal": all(r["same_forward"] for r in per_rank),
        "metrics_max_rel_diff": {
            k: float(f"{v:.3g}") for k, v in r0["metrics_max_rel_diff"].items()
        },
        "params_max_rel_l2": float(f"{max(r['params_max_rel_l2'] for r in per_rank):.3g}"),
        "first_step_max_abs_diff": r0["first_step_max_abs_diff"],
        "grad_norms": r0["grad_norms"],
    }
    print(json.dumps(result))
    ok = result["first_step_forward_equal"] and all(
        v == 0.0 for v in r0["first_step_max_abs_diff"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
