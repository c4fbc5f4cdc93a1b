"""The trainer's strict CPU train step, this tree against an earlier commit, side by side.

What ``posttrain grpo`` trains by default, without the rest of the stack (the recipe's policy,
LoRA on the recipe's targets or ``--train full``, strict numerics, FSDP over ``--world`` gloo
ranks at one torch thread each, 64 samples per step: ``bench_strict_train_step.step_samples``).
The library code of ``--base`` (a git revision: every package's ``src`` from ``git archive``)
and of this working tree run the same steps in separate process groups, alternating
(``--rounds`` rounds, each side ``--steps`` steps per round, the first ``--warmup`` of each
round left out of the medians; which side goes first alternates by round).

With ``--check bits`` (the default: a change that must not move a bit) the script checks that
both sides trained **bit for bit the same run**: every metric of every step, and a SHA-256 of
every trainable parameter's bytes after the last step, equal. With ``--check forward`` (a
change of the backward's numerics only, such as the BLAS backward of issue 38) it checks that
the first step's forward metrics (every metric but ``grad_norm``: the weights are still the
same) are equal on both sides, and that each side is reproducible (its runs of every round
bit for bit the same), and reports the largest relative difference of each metric between the
sides over all steps. Both check that the first step's trainer logprobs equal the strict
decode's (``train_rollout_logprob_max_abs_diff`` 0 on both sides). Reported: rank 0's median
step wall time and thread CPU time of each side, the ratios base / this tree, and the load
average before and after.
Command::

    uv run python packages/grpo/benchmarks/bench_train_step_ab.py --base 7dfd741
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _worker_rank(rank: int, world: int, args: argparse.Namespace, path: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_strict_train_step import _policy, recipe_config, recipe_steps

    from posttrain.grpo.trainer import train_step

    cfg = recipe_config(args.train, world, path)
    steps = recipe_steps(path, args.steps, args.samples)
    policy = _policy(path, cfg)
    walls, cpus, metrics = [], [], []
    for samples in steps:
        tokens = sum(x.response_len for x in samples)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        m = train_step(policy, samples[rank::world], cfg, global_batch_size=len(samples),
                       global_token_count=tokens)  # fmt: skip
        cpus.append(time.thread_time() - c0)
        walls.append(time.perf_counter() - t0)
        metrics.append(m)
    digest = hashlib.sha256()
    for p in policy.trainable():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        digest.update(full.contiguous().view(torch.uint8).numpy().tobytes())
    return {"walls": walls, "cpus": cpus, "metrics": metrics, "params_sha256": digest.hexdigest()}


def _worker(args: argparse.Namespace) -> int:
    from posttrain.grpo.recipe import cache_dir, prepare
    from posttrain.interface.processes import run_workers

    path = prepare(cache_dir(), args.seed)["policy"]
    per_rank = run_workers(_worker_rank, args.world, args=(args, path), timeout_s=1800.0)
    print(json.dumps(per_rank[0]))
    return 0


def _base_tree(rev: str, into: Path) -> list[str]:
    """Every package's ``src`` of ``rev`` under ``into``; returns the src folders."""
    data = subprocess.run(
        ["git", "archive", "--format=tar", rev, "packages"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if "/src/" in m.name]
        tar.extractall(into, members=members, filter="data")
    return sorted(str(p) for p in (into / "packages").glob("*/src"))


def _run_side(src_dirs: list[str], args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if src_dirs:  # ahead of the editable installs of this tree
        env["PYTHONPATH"] = os.pathsep.join([*src_dirs, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--samples",
           str(args.samples), "--world", str(args.world), "--train", args.train, "--seed",
           str(args.seed)]  # fmt: skip
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="7dfd741", help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=1, help="steps of a round left out")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (all ranks)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--train", choices=("lora", "full"), default="lora")
    parser.add_argument("--seed", type=int, default=0, help="the recipe's seed")
    parser.add_argument("--check", choices=("bits", "forward"), default="bits",
                        help="bits: the same run bit for bit; forward: the first step's forward "
                        "metrics equal, each side reproducible")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    sides = ("base", "tree")
    walls: dict[str, list[float]] = {s: [] for s in sides}
    cpus: dict[str, list[float]] = {s: [] for s in sides}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        dirs = {"base": _base_tree(args.base, Path(tmp)), "tree": []}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                res = _run_side(dirs[side], args)
                runs[side].append(res)
                walls[side].extend(res["walls"][args.warmup :])
                cpus[side].extend(res["cpus"][args.warmup :])
    load_after = os.getloadavg()
    reference = runs["base"][0]
    same = all(
        run["metrics"] == reference["metrics"]
        and run["params_sha256"] == reference["params_sha256"]
        for side in sides
        for run in runs[side]
    )
    reproducible = all(
        run["metrics"] == runs[side][0]["metrics"]
        and run["params_sha256"] == runs[side][0]["params_sha256"]
        for side in sides
        for run in runs[side]
    )
    forward = {k: v for k, v in reference["metrics"][0].items() if k != "grad_norm"}
    same_forward = all(
        {k: run["metrics"][0][k] for k in forward} == forward
        for side in sides
        for run in runs[side]
    )
    rel_diff = {
        key: max(
            abs(a[key] - b[key]) / max(abs(b[key]), 1e-30)
            for a, b in zip(runs["tree"][0]["metrics"], reference["metrics"], strict=True)
        )
        for key in reference["metrics"][0]
    }
    diff = "train_rollout_logprob_max_abs_diff"
    first_diff = {s: runs[s][0]["metrics"][0][diff] for s in sides}
    med = {s: round(statistics.median(walls[s]), 4) for s in sides}
    cpu = {s: round(statistics.median(cpus[s]), 4) for s in sides}
    result = {
        "base": args.base, "train": args.train, "world": args.world, "samples": args.samples,
        "rounds": args.rounds, "steps_per_round": args.steps,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
        "step_median_s": med, "speedup": round(med["base"] / med["tree"], 2),
        "step_cpu_median_s": cpu, "speedup_cpu": round(cpu["base"] / cpu["tree"], 2),
        "check": args.check, "bit_identical": same, "reproducible": reproducible,
        "first_step_forward_equal": same_forward, "first_step_max_abs_diff": first_diff,
        "metrics_max_rel_diff": {k: float(f"{v:.3g}") for k, v in rel_diff.items()},
        "grad_norms": [m["grad_norm"] for m in reference["metrics"]],
        "walls_s": {s: [round(w, 4) for w in walls[s]] for s in sides},
    }  # fmt: skip
    print(json.dumps(result))
    ok = same if args.check == "bits" else same_forward and reproducible
    return 0 if ok and all(v == 0.0 for v in first_diff.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
