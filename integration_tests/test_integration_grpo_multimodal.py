"""``posttrain grpo --task shapes``: multimodal GRPO on CPU, the whole stack in real processes.

The recipe warms up a ``multimodal_tiny`` policy (decoder + frozen vision and audio towers) on
the shapes task (count or name the coloured squares in an 8x8 image); the engines serve it,
the session router forwards each prompt's image as ``image_data`` and records it on the
sample (samples/2), and the trainer rebuilds the exact input from that reference. Full-weight
training with ``--offload-engines``: around every train step the engines release their memory
and get it back zero-filled, so every sync must re-send every weight, the frozen towers too
(their condition reads the model's structure). A missed tensor would make the engines answer
503 naming it, and any difference in the towers or the media path would show in the parity.

Asserted: the run finishes, the train/rollout logprob difference is exactly 0 on every step,
every step's sync re-sent the towers, and the reward rises.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grpo_runs import records, run_grpo

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(900)]


def test_shapes_full_training_with_engine_offload_raises_reward_at_exact_parity(
    recipe_cache: Path, tmp_path: Path
) -> None:
    summary = run_grpo(recipe_cache, tmp_path, "--task", "shapes", "--train", "full",
                       "--steps", "6", trainer=("--offload-engines",))  # fmt: skip
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == list(range(6))
    for r in steps:
        assert r["train_rollout_logprob_abs_diff"] == 0.0
        assert r["train_rollout_logprob_max_abs_diff"] == 0.0
        assert r["sync_towers"] == 1.0  # re-sent after every offload/onload cycle
    first = steps[0]["reward_mean"]
    assert max(r["reward_mean"] for r in steps[2:]) >= first + 0.2, [
        r["reward_mean"] for r in steps
    ]
    assert summary is not None
