"""``posttrain demo`` end to end: launch starts models, local-engine, sgl-router and session-router
as processes, holds a chat and reads the sample with posttrain.formats.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.multiproc
@pytest.mark.slow
def test_demo_runs_the_rollout_path_end_to_end() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.launch", "demo", "--engines", "1", "--turns", "2",
         "--max-tokens", "4"],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "its rollout logprobs are exactly the engine's: True" in done.stdout
    assert "session-router: http://127.0.0.1:" in done.stdout
