"""``posttrain grpo`` end to end (LoRA): it learns, parity is exact, a killed run resumes exactly.

Real processes throughout: the recipe's prepare step, two local engines (``--engines 2``: every
push reaches both, whatever the machine's core count would choose) behind the stock
sgl-router, the session router and two gloo trainer ranks, all started by ``posttrain grpo``
and stopped by pid. Three runs of 6 steps with a checkpoint every 3: one uninterrupted; one whose
trainer process (``python -m posttrain.grpo``, the launcher's child) is killed with SIGKILL right
after its first checkpoint (its gloo ranks die with it, the launcher stops the stack and exits
non-zero); that one resumed. The resumed run's
metrics (every field that does not measure time) equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from grpo_runs import grpo_argv, grpo_env, records, run_grpo

from posttrain.grpo.metrics import deterministic

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(900)]


def trainer_pid(launcher_pid: int) -> int:
    """The pid of the launcher's child running ``python -m posttrain.grpo`` (from /proc)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for child in children:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"posttrain.grpo" in argv:
            return int(child)
    raise AssertionError(f"no trainer among the launcher's children {children}")


def test_lora_learns_with_exact_parity_and_resumes_bit_for_bit(
    recipe_cache: Path, tmp_path: Path
) -> None:
    every = ("--checkpoint-every", "3")
    six = ("--steps", "6", "--engines", "2")
    whole = run_grpo(recipe_cache, tmp_path / "whole", *six, trainer=every)
    assert whole["steps"] == 6
    assert whole["train_rollout_logprob_abs_diff_all_zero"] is True
    assert whole["reward_gain"] >= 0.3, whole
    assert (tmp_path / "whole" / "reward_curve.png").stat().st_size > 1000
    assert (tmp_path / "whole" / "checkpoints" / "iter_0000005" / "adapter").is_dir()

    killed = tmp_path / "killed"
    log_path = tmp_path / "killed.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(grpo_argv(killed, *six, trainer=every),
                                env=grpo_env(recipe_cache), stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    marker = killed / "checkpoints" / "iter_0000002" / "meta.json"
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), (
        f"the run never wrote its first checkpoint (exit {proc.poll()}):\n"
        + log_path.read_text(errors="replace")[-4000:]
    )
    trainer = trainer_pid(proc.pid)
    os.kill(trainer, signal.SIGKILL)
    assert proc.wait(timeout=120) != 0, "the launcher must report its trainer's death"
    time.sleep(2)  # the trainer ranks follow their parent (PR_SET_PDEATHSIG)

    run_grpo(recipe_cache, killed, *six, "--resume", str(killed), trainer=every)
    got, want = records(killed), records(tmp_path / "whole")
    assert [r["step"] for r in got] == list(range(6))
    assert [deterministic(r) for r in got] == [deterministic(r) for r in want]
