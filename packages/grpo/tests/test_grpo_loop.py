"""The loop's rank launcher: forked gloo ranks, and a failing rank as one named run error."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.grpo import GrpoConfig, GrpoRunError
from posttrain.grpo.loop import run

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(120)
def test_a_rank_that_fails_is_one_run_error_naming_the_rank_and_cause(tmp_path: Path) -> None:
    cfg = GrpoConfig(
        model_path=tmp_path / "missing",
        rollout_url="http://127.0.0.1:9",
        engine_urls=("http://127.0.0.1:9",),
        out_dir=tmp_path / "out",
    )
    with pytest.raises(GrpoRunError, match=r"trainer rank [01]: .*missing/config\.json") as info:
        run(cfg)
    assert "Traceback" not in str(info.value)  # one line for the CLI, not the rank's stack
