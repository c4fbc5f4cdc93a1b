"""``posttrain grpo`` in its other modes: full-weight training, OPD, NVFP4 rollouts.

Each runs the whole embedded recipe for a few steps with real processes (see
``test_integration_grpo_lora``):

* ``--train full``: weights go to the engines over wsync/1 every step and the trainer's
  recomputed logprobs still equal the engine's exactly; the reward rises.
* ``--opd``: a stronger local teacher scores the student's tokens; the reverse KL to it falls.
* ``--rollout-quant nvfp4``: the engines serve the policy with NVFP4 experts; the train/rollout
  mismatch is reported (non-zero) and truncated importance sampling weighs the loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grpo_runs import records, run_grpo

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(900)]


def test_full_weight_training_keeps_exact_parity(recipe_cache: Path, tmp_path: Path) -> None:
    summary = run_grpo(recipe_cache, tmp_path, "--train", "full", "--steps", "4")
    steps = records(tmp_path)
    assert summary["train_rollout_logprob_abs_diff_all_zero"] is True
    assert all(r["train_rollout_logprob_max_abs_diff"] == 0.0 for r in steps)
    assert all(r["sync_bytes"] > 100_000 for r in steps)  # every weight, not an adapter
    assert max(r["reward_mean"] for r in steps[1:]) >= steps[0]["reward_mean"] + 0.3


def test_opd_reverse_kl_to_the_teacher_falls(recipe_cache: Path, tmp_path: Path) -> None:
    summary = run_grpo(recipe_cache, tmp_path, "--opd", "--steps", "5")
    steps = records(tmp_path)
    rkl = [r["opd_reverse_kl"] for r in steps]
    assert rkl[0] > 0.5
    assert min(rkl[-2:]) < 0.75 * rkl[0], rkl
    assert summary["train_rollout_logprob_abs_diff_all_zero"] is True


def test_nvfp4_rollouts_report_the_mismatch_and_apply_tis(
    recipe_cache: Path, tmp_path: Path
) -> None:
    summary = run_grpo(recipe_cache, tmp_path, "--rollout-quant", "nvfp4", "--steps", "2")
    steps = records(tmp_path)
    assert summary["rollout_quant"] == "nvfp4"
    for r in steps:
        assert r["train_rollout_logprob_abs_diff"] > 0.0
        assert r["train_rollout_logprob_equal_frac"] < 1.0
        assert "tis_weight_mean" in r
        assert r["tis_weight_mean"] != 1.0
