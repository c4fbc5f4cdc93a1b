"""Where the trainer's strict CPU train step spends its time, phase by phase and op by op.

The step ``posttrain grpo`` trains by default, without the rest of the stack: the recipe's
policy, LoRA on the recipe's targets (``--train full`` for full weights), strict numerics,
FSDP over ``--world`` gloo ranks at one torch thread each, 64 samples per step (8 prompts x 8
samples of the recipe's chat prompts, 1-4 response tokens; ``bench_strict_train_step.step_samples``)
split over the ranks. After ``--warmup`` steps, rank 0 profiles ``--steps`` more:

* **phases** (cProfile, cumulative seconds per step): packing the batch, the forward
  (``forward_logits`` and the logprob pick), the objective, the backward, the gradient
  reduction (FSDP's or lora-core's), clipping, AdamW, combining the metrics over the ranks;
* **ops** (``torch.profiler``, one more step): the aten ops and autograd nodes by self CPU
  time, with their call counts (``--rows`` of them).

Command (prints a JSON summary last; ``--table`` also prints the op table)::

    uv run python packages/grpo/benchmarks/profile_strict_train_step.py --table
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_strict_train_step import _policy, recipe_config, recipe_steps

from posttrain.grpo.recipe import cache_dir, prepare
from posttrain.grpo.trainer import train_step
from posttrain.interface.processes import run_workers

# phase -> (file suffix, function name) of the cProfile entry whose cumulative time it is
PHASES: dict[str, tuple[str, str]] = {
    "pack": ("grpo/batch.py", "pack"),
    "forward": ("grpo/step.py", "_response_logprobs"),
    "objective": ("grpo/objective.py", "policy_objective"),
    "backward": ("torch/_tensor.py", "backward"),
    "reduce_gradients": ("grpo/fsdp_backend.py", "reduce"),
    "clip": ("fsdp_mesh/_clip.py", "scale_grads_to_norm"),
    "optimizer": ("torch/optim/optimizer.py", "wrapper"),
    "combine_metrics": ("grpo/step.py", "_combine"),
    "train_step": ("grpo/step.py", "train_step"),
}


def _phase_seconds(stats: pstats.Stats, steps: int) -> dict[str, float]:
    out: dict[str, float] = {}
    entries: Any = stats.stats  # type: ignore[attr-defined]
    for phase, (suffix, name) in PHASES.items():
        total = 0.0
        for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in entries.items():
            if func == name and filename.replace("\\", "/").endswith(suffix):
                total = max(total, ct)
        out[phase] = round(total / steps, 4)
    return out


def _rank(rank: int, world: int, args: argparse.Namespace, path: str) -> dict[str, Any]:
    cfg = recipe_config(args.train, world, path)
    total = args.warmup + args.steps + 1
    steps = recipe_steps(path, total, args.samples)
    policy = _policy(path, cfg)

    def run(s: int) -> dict[str, float]:
        samples = steps[s]
        tokens = sum(x.response_len for x in samples)
        return train_step(policy, samples[rank::world], cfg, global_batch_size=len(samples),
                          global_token_count=tokens)  # fmt: skip

    for s in range(args.warmup):
        run(s)
    dist.barrier()
    walls = []
    profiler = cProfile.Profile()
    for s in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        profiler.enable()
        run(s)
        profiler.disable()
        walls.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(total - 1)
    if rank != 0:
        return {}
    stats = pstats.Stats(profiler)
    events = prof.key_averages()
    self_total = sum(e.self_cpu_time_total for e in events)
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]
    return {
        "step_wall_s": round(statistics.median(walls), 4),
        "phases_s": _phase_seconds(stats, args.steps),
        "op_calls": sum(e.count for e in events if e.key.startswith("aten::")),
        "ops": [
            {
                "op": e.key,
                "calls": e.count,
                "self_ms": round(e.self_cpu_time_total / 1e3, 2),
                "share": round(e.self_cpu_time_total / max(self_total, 1), 3),
            }
            for e in ops
        ],
        "table": events.table(sort_by="self_cpu_time_total", row_limit=args.rows)
        if args.table
        else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64, help="samples per step (all ranks)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--train", choices=("lora", "full"), default="lora")
    parser.add_argument("--seed", type=int, default=0, help="the recipe's seed")
    parser.add_argument("--rows", type=int, default=25, help="ops listed")
    parser.add_argument("--table", action="store_true", help="print torch.profiler's table")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    path = prepare(cache_dir(), args.seed)["policy"]
    load_before = os.getloadavg()
    r0 = run_workers(_rank, args.world, args=(args, path), timeout_s=1800.0)[0]
    table = r0.pop("table")
    if table:
        print(table)
    result = {
        "train": args.train, "world": args.world, "samples": args.samples,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()], **r0,
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
