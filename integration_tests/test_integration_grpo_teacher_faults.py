"""``posttrain grpo --opd`` against a faulty teacher: one that answers 503 first, one that hangs.

The student stack is the real one ``posttrain grpo`` starts (its local engines, sgl-router, the
session router, two gloo trainer ranks). The teacher is given with ``--teacher URL`` and sits
behind ``faults.FlakyTeacher``, an HTTP server of this test process on 127.0.0.1:

* In front of a real teacher engine (``posttrain.local_engine`` serving the recipe's teacher),
  its first three ``/generate`` requests answer 503: the client retries them, every step
  completes, the run counts the retries (``opd_teacher_retries``: exactly the 503s answered),
  and the reverse KL to the teacher still falls.
* With no teacher behind it, it never answers: the step ends with opd-scoring's
  ``TeacherUnavailableError`` (named in the trainer's error), the client gives up within the
  configured deadline (``--rollout-timeout-s``, which bounds each teacher sample) plus a
  margin, no step is recorded, and the run exits non-zero.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import FlakyTeacher
from grpo_runs import grpo_argv, grpo_env, prepared_recipe, records, run_grpo

from posttrain.interface.testing import ServerProcess, free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(900)]

DEADLINE_S = 20.0
MARGIN_S = 15.0  # cancelling the in-flight requests and closing their connections


@pytest.fixture(scope="module")
def teacher_engine(recipe_cache: Path) -> Iterator[str]:
    teacher = prepared_recipe(recipe_cache)["teacher"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", teacher,
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1"]  # fmt: skip
    with ServerProcess(argv, f"{url}/health", timeout_s=300):
        yield url


def test_opd_steps_complete_through_a_teacher_answering_503_first(
    recipe_cache: Path, teacher_engine: str, tmp_path: Path
) -> None:
    with FlakyTeacher(teacher_engine, fail_first=3) as teacher:
        summary = run_grpo(recipe_cache, tmp_path, "--opd", "--teacher", teacher.url,
                           "--steps", "5")  # fmt: skip
        injected, relayed = teacher.answered_503, teacher.upstream_errors
        requests = teacher.generate_requests
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == list(range(5))
    assert injected == 3
    samples = sum(int(r["samples"]) for r in steps)
    assert requests == samples + injected + relayed  # each sample scored once, each 503 retried
    # Every failed answer was retried and counted: the injected ones on the first step (plus
    # any the real teacher gave itself, e.g. a full queue, relayed as they were).
    assert steps[0]["opd_teacher_retries"] >= 3.0
    assert summary["opd_teacher_retries"] == float(injected + relayed)
    for r in steps:  # finite numbers everywhere, the teacher signal present
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    rkl = [r["opd_reverse_kl"] for r in steps]
    assert rkl[0] > 0.5
    assert min(rkl[-2:]) < 0.75 * rkl[0], rkl
    assert summary["train_rollout_logprob_abs_diff_all_zero"] is True


def test_a_teacher_that_never_answers_ends_the_step_with_a_named_error(
    recipe_cache: Path, tmp_path: Path
) -> None:
    argv = grpo_argv(tmp_path, "--opd", "--steps", "1", "--teacher", "TEACHER",
                     trainer=("--rollout-timeout-s", str(DEADLINE_S)))  # fmt: skip
    with FlakyTeacher(None, hang=True) as teacher:
        argv[argv.index("TEACHER")] = teacher.url
        done = subprocess.run(argv, env=grpo_env(recipe_cache), capture_output=True, text=True,
                              timeout=600, check=False)  # fmt: skip
        exited = time.monotonic()
        first, abandoned = teacher.first_generate_at, teacher.abandoned_at
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "TeacherUnavailableError" in output, output[-3000:]
    assert "step 0" in output, output[-3000:]
    assert first is not None, "the trainer never asked the teacher"
    assert abandoned is not None, "the trainer never gave up on the hung teacher"
    assert DEADLINE_S * 0.9 <= abandoned - first < DEADLINE_S + MARGIN_S
    assert exited - first < DEADLINE_S + MARGIN_S + 60  # + stopping the stack, by pid
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step was recorded
