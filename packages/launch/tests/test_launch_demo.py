"""``posttrain demo``: the CPU rollout path end to end (the sample is read with posttrain.formats)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from posttrain.launch.demo import DemoConfig, DemoError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"turns": 0}, "--turns"), ({"turns": 4}, "--turns"), ({"max_tokens": 0}, "--max-tokens"),
     ({"engines": 0}, "--engines")],
)  # fmt: skip
def test_config_errors_name_the_flag(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(DemoError, match=message):
        DemoConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.multiproc
@pytest.mark.slow
def test_demo_runs_the_rollout_path_end_to_end() -> None:
    pytest.importorskip("posttrain.local_engine")
    pytest.importorskip("posttrain.session_router")
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.launch", "demo", "--engines", "1", "--turns", "2",
         "--max-tokens", "4"],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "its rollout logprobs are exactly the engine's: True" in done.stdout
    assert "session-router: http://127.0.0.1:" in done.stdout
