"""Regression test for trap 1 of issue 25: the first step after a resume starts from the
loaded values (an adapter, or full weights), never from master copies taken before the load.

Each case trains one step (run A), checkpoints, and takes A's second step as the reference:
that step starts from exactly the values the checkpoint holds. A fresh policy resumed from the
checkpoint must then take the same second step, bit for bit (one rank, same kernels). The
``masters_before_load`` variant reintroduces the published bug (fp32 masters snapshotted when
the optimizer is built, before the load; see ``grpo_resume_workers``) and must be caught.
"""

from __future__ import annotations

from typing import Any

import grpo_resume_workers as workers
import pytest
import torch
from grpo_workers import save_tiny_checkpoint

from posttrain.interface.testing import run_workers

pytestmark = [pytest.mark.multiproc]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("grpo-resume") / "tiny"
    return save_tiny_checkpoint(path, max_positions=32, seed=5)


CASES = [("lora", "fp32"), ("full", "fp32"), ("full", "bf16")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def run(
    request: pytest.FixtureRequest, ckpt: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    train, precision = request.param
    out = str(tmp_path_factory.mktemp(f"resume-{train}-{precision}"))
    return run_workers(  # type: ignore[no-any-return]
        workers.resume_then_step, 1, args=(ckpt, out, train, precision), timeout_s=240
    )[0]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_moves_the_weights(run: dict[str, Any]) -> None:
    """The load is a real change: the checkpointed values differ from a fresh build's."""
    assert not _equal(run["initial"], run["loaded"])
    for variant in workers.VARIANTS:
        assert _equal(run[variant]["at_load"], run["loaded"]), variant


@pytest.mark.parametrize(
    ("variant", "starts_from_loaded"),
    [("no_masters", True), ("masters_after_load", True), ("masters_before_load", False)],
)
def test_first_step_after_resume_starts_from_the_loaded_values(
    run: dict[str, Any], variant: str, starts_from_loaded: bool
) -> None:
    """grpo's order (``no_masters``: the parameters are the masters) and masters taken after
    the load equal the reference step; masters taken before the load (the bug) do not."""
    after = run[variant]["after_step"]
    assert run[variant]["metrics"]["skipped_step"] == 0.0
    assert _equal(after, run["reference"]) is starts_from_loaded
    if not starts_from_loaded:  # the stale masters won: the step started from the fresh build
        assert any(not torch.equal(after[k], run["reference"][k]) for k in after)
