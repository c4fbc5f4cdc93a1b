"""The parity command: ``python -m posttrain.fsdp_mesh.parity`` over ``run_parity``.

Command (two ways to run it; both print a short summary, one line per check, and
``PASS r{R}s{S}`` (exit 0) or ``FAIL r{R}s{S}`` (exit 1); ``--json PATH`` writes the full report,
every rank's numbers, to a file; the self-spawning mode shows a spinner with the elapsed time
while the ranks run). argparse, not typer (the project's CLI library): every rank of a torchrun
job parses the same argv, and the command needs nothing beyond the package's own dependencies
(torch, and rich for the spinner).

* self-spawning: ``python -m posttrain.fsdp_mesh.parity --replicate R --shard S [--backend
  gloo|nccl]`` starts R*S local ranks itself (nccl: rank g on ``cuda:g``);
* torchrun: ``torchrun --nproc-per-node N [--nnodes ...] -m posttrain.fsdp_mesh.parity
  --replicate R --shard S --backend nccl``; detected from ``RANK``/``WORLD_SIZE`` in the
  environment, device ``cuda:LOCAL_RANK``. Multi-node runs need ``--checkpoint-dir`` on a
  shared filesystem.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.formats import write_text_atomic
from posttrain.fsdp_mesh._errors import MeshConfigError
from posttrain.fsdp_mesh._parity import ParityConfig, run_parity
from posttrain.interface import ConfigError, MeshSpec, WorkerError
from posttrain.interface.processes import run_workers

__all__ = ["main"]

# What a forkserver imports once, so each parity group starts without one torch import per rank.
FORKSERVER_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.optim",
)


def _spawned_worker(rank: int, world_size: int, config: ParityConfig) -> dict[str, Any]:
    return run_parity(config).to_json()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except where there is none (required) or the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        # the console script's own name when it runs as one (pyproject's [project.scripts])
        prog="posttrain-fsdp-parity"
        if Path(sys.argv[0]).name == "posttrain-fsdp-parity"
        else "python -m posttrain.fsdp_mesh.parity",
        description="Check HSDP gradients, cross-rank bit-exactness and checkpoint round trips "
        "against a single-process reference.",
        formatter_class=_DefaultsFormatter,
    )
    parser.add_argument("--replicate", type=int, required=True, help="dp_replicate size R")
    parser.add_argument("--shard", type=int, required=True, help="dp_shard size S")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo (CPU) or nccl (one GPU per rank)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--dim", type=int, default=30, help="width of the test MLP")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="shared dir for the DCP round trip (default: a temp dir)")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the full report (every rank's numbers) to PATH "
                        "(default: none)")  # fmt: skip
    parser.add_argument(
        "--start-method",
        choices=("spawn", "forkserver", "fork"),
        default="spawn",
        help="how the self-spawning mode starts ranks (ignored under torchrun)",
    )
    return parser.parse_args(argv)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _finish(args: argparse.Namespace, config: ParityConfig, reports: list[dict[str, Any]]) -> int:
    passed = all(r["passed"] for r in reports)
    tag = f"r{args.replicate}s{args.shard}"
    summary = {
        "layout": tag,
        "backend": args.backend,
        "passed": passed,
        "tolerance": {"rtol": config.rtol, "atol": config.atol},
        "max_grad_err": max(r["max_grad_err"] for r in reports),
        "max_param_err": max(r["max_param_err"] for r in reports),
        "median_step_s": _median([r["median_step_s"] for r in reports]),
        "ranks": reports,
    }
    if args.json:
        try:
            write_text_atomic(args.json, json.dumps(summary, indent=2) + "\n")
        except OSError as exc:
            print(
                f"FAIL r{args.replicate}s{args.shard}: --json {args.json}: {exc}", file=sys.stderr
            )
            return 2
    for line in _summary_lines(summary, config):
        print(line)
    if args.json:
        print(f"full report (every rank): {args.json}")
    print(f"PASS {tag}" if passed else f"FAIL {tag}")
    return 0 if passed else 1


def _summary_lines(summary: dict[str, Any], config: ParityConfig) -> list[str]:
    """What a person reads: the layout, the worst numbers, then each rank's failures."""
    ranks: list[dict[str, Any]] = summary["ranks"]
    failures = [f"rank {r['rank']}: {f}" for r in ranks for f in r["failures"]]
    step = summary["median_step_s"]
    exact = all(r["checkpoint_exact"] for r in ranks)
    return [
        f"HSDP parity {summary['layout']} on {summary['backend']}: {len(ranks)} ranks, "
        f"{config.steps} AdamW steps of {config.micro_batches} micro-batches, dim {config.dim}"
        + (f", median step {step:.3f} s" if step is not None else ""),
        f"  vs single process: max grad err {summary['max_grad_err']:.2e}, max param err "
        f"{summary['max_param_err']:.2e} (rtol {config.rtol:g}, atol {config.atol:g})",
        f"  checkpoint round trip: {'exact' if exact else 'NOT exact'}; replicate all-reduces "
        f"on the first step: {ranks[0]['replicate_all_reduces']} "
        f"({ranks[0]['fsdp_groups']} FSDP groups)",
        f"  checks failed: {len(failures)}" if failures else "  every check passed",
        *[f"  {f}" for f in failures[:10]],
    ]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m posttrain.fsdp_mesh.parity`` (torchrun or self-spawning)."""
    args = _parse_args(argv)
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"FAIL r{args.replicate}s{args.shard}: {exc}", file=sys.stderr)
        return 2
    if args.json:  # refused before the run, not after it
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(
                f"FAIL r{args.replicate}s{args.shard}: --json {args.json}: {exc}", file=sys.stderr
            )
            return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _main_torchrun(args, config)
    try:
        with _spinner(
            f"running {args.replicate * args.shard} {args.backend} ranks "
            f"(r{args.replicate}s{args.shard}) next to a single-process reference"
        ):
            reports = run_workers(
                _spawned_worker,
                args.replicate * args.shard,
                timeout_s=args.timeout,
                backend=args.backend,
                args=(config,),
                start_method=args.start_method,
                threads_per_rank=None,  # torch's default: a parity run is not a unit test
                preload=FORKSERVER_PRELOAD,
            )
    except WorkerError as exc:
        print(f"FAIL r{args.replicate}s{args.shard}: {exc}", file=sys.stderr)
        return 1
    return _finish(args, config, reports)


@contextlib.contextmanager
def _spinner(description: str) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while the ranks run (they print nothing)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:  # fmt: skip
        progress.add_task(description, total=None)
        yield


def _config(args: argparse.Namespace) -> ParityConfig:
    """The run's config; validates the layout before any process starts (ConfigError)."""
    if not 0 < args.timeout < math.inf:
        raise MeshConfigError(
            f"--timeout must be a finite number of seconds > 0, got {args.timeout}"
        )
    config = ParityConfig(
        replicate=args.replicate,
        shard=args.shard,
        device_type="cuda" if args.backend == "nccl" else "cpu",
        steps=args.steps,
        micro_batches=args.micro_batches,
        dim=args.dim,
        checkpoint_dir=args.checkpoint_dir,
    )
    MeshSpec(
        world_size=args.replicate * args.shard,
        replicate=args.replicate,
        shard=args.shard,
        device_type=config.device_type,
    )
    return config


def _main_torchrun(args: argparse.Namespace, config: ParityConfig) -> int:
    device_id = None
    if args.backend == "nccl":
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
    dist.init_process_group(
        args.backend, timeout=timedelta(seconds=args.timeout), device_id=device_id
    )
    try:
        if dist.get_world_size() != args.replicate * args.shard:
            raise MeshConfigError(
                f"torchrun started {dist.get_world_size()} ranks but --replicate {args.replicate} "
                f"x --shard {args.shard} = {args.replicate * args.shard}"
            )
        report = run_parity(config).to_json()
        box: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, report)
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]) != 0:
        return 0 if report["passed"] else 1
    return _finish(args, config, box)
