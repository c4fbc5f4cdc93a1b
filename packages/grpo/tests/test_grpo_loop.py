"""The loop's rank launcher: forked gloo ranks, and a failing rank as one named run error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from posttrain.grpo import GrpoConfig, GrpoRunError
from posttrain.grpo.loop import run
from posttrain.interface import Sample

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(120)
def test_a_rank_that_fails_is_one_run_error_naming_the_rank_and_cause(tmp_path: Path) -> None:
    import json

    from posttrain.grpo import GrpoConfigError
    from posttrain.models import ModelConfig

    no_weights = tmp_path / "no-weights"  # the model gate reads config.json only: ranks start
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
    cfg = GrpoConfig(
        model_path=no_weights,
        rollout_url="http://127.0.0.1:9",
        engine_urls=("http://127.0.0.1:9",),
        out_dir=tmp_path / "out",
    )
    with pytest.raises(GrpoRunError, match=r"trainer rank [01]: .*model\.safetensors") as info:
        run(cfg)
    assert "Traceback" not in str(info.value)  # one line for the CLI, not the rank's stack
    # a model path that does not exist fails before any rank starts (the model gate)
    with pytest.raises(GrpoConfigError, match=r"--model-path.*missing"):
        run(GrpoConfig(**{**cfg.to_dict(), "model_path": tmp_path / "missing"}))


class _KilledError(Exception):
    """Stands for a kill right after a checkpoint is written."""


class _FixedEngine:
    """An in-process ``RolloutEngine``: every sample answers one fixed token."""

    async def rollout(
        self, messages: Any, *, sampling_params: Any = None, weight_version: int | None = None
    ) -> Sample:
        return Sample(prompt_ids=[2, 5], response_ids=[7], rollout_logprobs=[-0.1], loss_mask=[1],
                      weight_version=weight_version)  # fmt: skip


@pytest.mark.timeout(240)
def test_a_kill_after_a_checkpoint_loses_no_metrics_line(tmp_path: Path) -> None:
    """Each step's ``metrics.jsonl`` line is written before its checkpoint: a run killed right
    after saving step 1 has step 1's line, and its resume (from step 1's checkpoint) adds step 2's:
    one line per step, none lost. The runs train in a forked process: a backward pass in
    pytest's own process would break every later test that forks ranks (autograd's threads and
    fork do not mix)."""
    from posttrain.interface.processes import run_workers

    run_workers(_kill_then_resume, 1, args=(tmp_path,), backend=None, timeout_s=200)


def _kill_then_resume(rank: int, world: int, tmp_path: Path) -> None:
    """The body of the test above, in its own process (single rank, in-process ``run``)."""
    from grpo_workers import RecordingSink, save_tiny_checkpoint

    from posttrain.grpo import checkpoint, loop
    from posttrain.grpo.rewards import Prompt, Task

    real_save = checkpoint.save

    def save_then_die(root: Path, step: int, policy: Any, extra: dict[str, Any]) -> Path:
        path = real_save(root, step, policy, extra)
        if step == 1:
            raise _KilledError
        return path

    model = save_tiny_checkpoint(tmp_path / "tiny")
    prompts = tuple(Prompt(index=i, messages=({"role": "user", "content": f"{i}+1="},),
                           metadata={"answer": str(i + 1)}) for i in range(4))  # fmt: skip
    task = Task(name="fixed", prompts=prompts, reward=lambda sample: float(sample.index % 2))
    out = tmp_path / "out"
    cfg = GrpoConfig(model_path=Path(model), replicate=1, shard=1, steps=3, checkpoint_every=1,
                     prompts_per_step=2, samples_per_prompt=2, out_dir=out)  # fmt: skip
    torchrun_names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    environ_before = {name: os.environ.get(name) for name in torchrun_names}
    loop.checkpoint.save = save_then_die  # type: ignore[assignment]
    with pytest.raises(_KilledError):
        run(cfg, task=task, engine=_FixedEngine(), weight_sinks=[RecordingSink()])
    loop.checkpoint.save = real_save  # type: ignore[assignment]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]
    assert checkpoint.find(out).name == "iter_0000001"
    resumed = GrpoConfig(**{**cfg.to_dict(), "resume": out})
    summary = run(resumed, task=task, engine=_FixedEngine(), weight_sinks=[RecordingSink()])
    assert summary is not None
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["step"] for r in records[:2]] == [json.loads(x)["step"] for x in lines]
    assert records[1] == json.loads(lines[1])  # the killed run's line, kept as written
    # a resume with other prompts is refused by name (rank 0 checks; every rank raises it)
    other = Task(name="other", prompts=prompts[:3], reward=task.reward)
    with pytest.raises(GrpoRunError, match=r"--resume .*: the prompts differ from the checkpoint"):
        run(resumed, task=other, engine=_FixedEngine(), weight_sinks=[RecordingSink()])
    # the in-process single rank left this process's torchrun variables as they were (a
    # leftover RANK would make the next in-process run think it is under torchrun)
    assert {name: os.environ.get(name) for name in torchrun_names} == environ_before
