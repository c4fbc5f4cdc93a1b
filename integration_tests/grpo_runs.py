"""``posttrain grpo`` run as a user runs it: a subprocess of this interpreter, its files read back.

Every run gets ``POSTTRAIN_CACHE`` (the session's ``recipe_cache`` fixture, so the recipe warms
up once per session) and writes to the ``--out`` directory it is given; the trainer's own flags
go after ``--``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def grpo_argv(out: Path, *flags: str, trainer: tuple[str, ...] = ()) -> list[str]:
    """``posttrain grpo`` with ``flags``, and ``trainer`` after ``--``. Without a mesh flag of
    its own the trainer runs on two gloo ranks (``--shard 2``): the tests exercise the
    distributed trainer, which the 2-core default (one rank) would leave out."""
    argv = [sys.executable, "-m", "posttrain.launch", "grpo", "--out", str(out), *flags]
    mesh = any(a.split("=")[0] in ("--shard", "--replicate") for a in trainer)
    trainer = trainer if mesh else (*trainer, "--shard", "2")
    return [*argv, "--", *trainer]


def grpo_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "POSTTRAIN_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


def records(out: Path) -> list[dict[str, Any]]:
    """The run's ``metrics.jsonl``: one record per step."""
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def reward_rise(steps: list[dict[str, Any]], k: int, *, first: int | None = None) -> float:
    """The mean ``reward_mean`` of the last ``k`` steps minus that of the first ``first``
    (default ``k``).

    A step's mean is over 8 prompts drawn afresh, so it moves by ~0.08 from step to step with no
    learning at all (the recipe at ``--lr 1e-12``: 0.11..0.39 over 10 steps); averaging ``k``
    steps at each end is what lets a learning check hold across draws, where one step against
    another is a coin toss near the margin. ``first=1`` compares with the untrained model's step
    alone: a run that learns within its first update has already risen at step 1, and averaging
    that step into the "before" side hides the rise it shows."""
    assert k > 0, k
    before = k if first is None else first
    assert before > 0, before
    assert k + before <= len(steps), (k, before, len(steps))
    rewards = [float(r["reward_mean"]) for r in steps]
    return sum(rewards[-k:]) / k - sum(rewards[:before]) / before


def run_grpo(cache: Path, out: Path, *flags: str, trainer: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run to the end (it must exit 0); returns its ``summary.json``."""
    done = subprocess.run(grpo_argv(out, *flags, trainer=trainer), env=grpo_env(cache),
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def prepared_recipe(cache: Path) -> dict[str, Any]:
    """The recipe's checkpoint paths and flags (``posttrain.grpo.recipe prepare``, cached)."""
    done = subprocess.run([sys.executable, "-m", "posttrain.grpo.recipe", "prepare"],
                          env=grpo_env(cache), capture_output=True, text=True, timeout=900,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
