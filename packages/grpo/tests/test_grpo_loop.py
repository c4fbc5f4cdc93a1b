"""The loop's rank launcher: forked gloo ranks, and a failing rank as one named run error; the
step's fault handling: aborted samples left out and named, unreachable engines dropped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from posttrain.grpo import GrpoConfig, GrpoRunError
from posttrain.grpo.loop import _drop_aborted, _drop_stale, run
from posttrain.interface import Sample, SampleStatus

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


def _sample(index: int, *, aborted: bool = False) -> Sample:
    if aborted:
        return Sample(prompt_ids=[], response_ids=[], rollout_logprobs=[], loss_mask=[],
                      status=SampleStatus.ABORTED, index=index, group_index=0,
                      metadata={"prompt_index": 7, "session_id": f"s{index}",
                                "abort_reason": "no reply within turn_timeout_s=3 s"})  # fmt: skip
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.5], loss_mask=[1],
                  index=index, group_index=0)  # fmt: skip


def test_aborted_samples_are_left_out_of_the_step_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples = [_sample(0), _sample(1, aborted=True), _sample(2)]
    with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
        kept, aborted = _drop_aborted(samples, step=5)
    assert [s.index for s in kept] == [0, 2]
    assert [s.index for s in aborted] == [1]
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("step 5: 1 of 3 samples aborted, left out of the step")
    assert "prompt 7 sample 1 (session s1): no reply within turn_timeout_s=3 s" in message
    assert _drop_aborted([_sample(0)], step=0) == ([_sample(0)], [])
    with pytest.raises(GrpoRunError, match="every one of the 2 samples was aborted"):
        _drop_aborted([_sample(0, aborted=True), _sample(1, aborted=True)], step=0)


def test_stale_samples_are_left_out_of_the_step_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples = [_sample(0), _sample(1), _sample(2)]
    samples[1].weight_version = 3
    samples[2].weight_version = 4
    with caplog.at_level(logging.WARNING, logger="posttrain.grpo"):
        kept, stale = _drop_stale(samples, step=2, version=4)
    assert [s.index for s in kept] == [0, 2]  # no version reported: nothing to compare
    assert [s.index for s in stale] == [1]
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("step 2: 1 of 3 samples came from an engine not at weight version 4")
    assert "sample 1 (engine weight versions [3])" in message
    with pytest.raises(GrpoRunError, match="every one of the 1 samples came from weights other"):
        _drop_stale([samples[1]], step=2, version=4)
