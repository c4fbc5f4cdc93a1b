"""``posttrain demo``: the CPU rollout path end to end, and its stdlib safetensors reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.launch.demo import DemoConfig, DemoError, read_safetensors


def test_reader_agrees_with_safetensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save

    tensors = {
        "tokens.0": torch.tensor([5, 6, 7], dtype=torch.int64),
        "loss_mask.0": torch.tensor([0, 1, 1], dtype=torch.uint8),
        "rollout_log_probs.0": torch.tensor([-0.25, -1.5], dtype=torch.float64),
    }
    parsed = read_safetensors(save(tensors))
    assert parsed["tokens.0"][0:2] == ("I64", [3])
    assert parsed["rollout_log_probs.0"][0:2] == ("F64", [2])
    from posttrain.launch.demo import _values

    assert _values(parsed["tokens.0"]) == [5, 6, 7]
    assert _values(parsed["loss_mask.0"]) == [0, 1, 1]
    assert _values(parsed["rollout_log_probs.0"]) == [-0.25, -1.5]
    with pytest.raises(DemoError, match="not a safetensors file"):
        read_safetensors(b"abc")


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
