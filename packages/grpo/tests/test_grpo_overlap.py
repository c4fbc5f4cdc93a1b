"""Where the loop's step batches come from: on-policy by default, one step stale with
``off_policy_overlap`` (the next step's rollout in a worker thread while this one trains)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from posttrain.grpo import GrpoConfig, GrpoConfigError, GrpoRunError
from posttrain.grpo.overlap import StepBatches


class Maker:
    """``make(step, version)``: a batch naming its step, version, thread and stream position."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[tuple[int, int, str]] = []
        self.position = 0
        self.fail_on = fail_on
        self.release = threading.Event()
        self.release.set()

    def __call__(self, step: int, version: int) -> dict[str, Any]:
        self.release.wait(10)
        self.calls.append((step, version, threading.current_thread().name))
        self.position += 8  # the step's prompts are taken from the stream
        if step == self.fail_on:
            raise GrpoRunError(f"rollout: step {step} failed")
        return {"step": step, "stats": {}, "times": {}}


def test_by_default_each_step_is_made_when_asked_on_policy_with_no_staleness_metric() -> None:
    make = Maker()
    batches = StepBatches(make, overlap=False, steps=3)
    for step in range(3):
        batch = batches.get(step, version=step)
        batches.start_next(step, step, make.position)  # does nothing on-policy
        assert batches.wait() == pytest.approx(0, abs=0.01)
        assert isinstance(batch, dict)
        assert batch["stats"] == {}  # default metrics are what they were
        assert batches.data_position(make.position) == make.position
    batches.close()
    main = threading.current_thread().name
    assert make.calls == [(0, 0, main), (1, 1, main), (2, 2, main)]
    assert not batches.overlap


def test_overlap_makes_the_next_step_on_the_current_weights_while_this_one_trains() -> None:
    make = Maker()
    batches = StepBatches(make, overlap=True, steps=3)
    staleness = []
    for step in range(3):
        version = step  # one weight sync per step
        batch = batches.get(step, version)
        assert isinstance(batch, dict)
        assert batch["step"] == step
        staleness.append(batch["stats"]["rollout_staleness"])
        before = make.position
        make.release.clear()  # the next rollout runs "while the trainer steps"
        batches.start_next(step, version, before)
        if step + 1 < 3:
            # a checkpoint now names the first prompt not yet trained: the next step's
            assert batches.data_position(before + 8) == before
        make.release.set()
        batches.wait()  # before the weight sync
    batches.close()
    assert staleness == [0.0, 1.0, 1.0]  # the first rollout overlapped nothing
    # step s+1 was made at version s (the weights served while step s trained), off the main thread
    assert [(s, v) for s, v, _ in make.calls] == [(0, 0), (1, 0), (2, 1)]
    assert {name for _, _, name in make.calls} != {threading.current_thread().name}
    assert len({name for _, _, name in make.calls}) == 1  # one worker thread: one event loop
    assert batches.data_position(make.position) == make.position  # nothing pending at the end


def test_an_overlapped_rollout_that_failed_is_the_next_steps_error() -> None:
    make = Maker(fail_on=1)
    batches = StepBatches(make, overlap=True, steps=3)
    assert isinstance(batches.get(0, 0), dict)
    batches.start_next(0, 0, 0)
    batches.wait()
    with pytest.raises(GrpoRunError, match=r"^rollout: step 1 failed$"):
        batches.get(1, 1)
    batches.close()


def test_the_flag_needs_importance_weighting_and_no_engine_offload(tmp_path: Path) -> None:
    with pytest.raises(GrpoConfigError, match=r"off_policy_overlap.*--tis tis"):
        GrpoConfig(off_policy_overlap=True)
    with pytest.raises(GrpoConfigError, match="offload_engines"):
        GrpoConfig(off_policy_overlap=True, tis="tis", offload_engines=True)
    assert GrpoConfig(off_policy_overlap=True, tis="tis").off_policy_overlap
    assert not GrpoConfig().off_policy_overlap  # the default stays on-policy
