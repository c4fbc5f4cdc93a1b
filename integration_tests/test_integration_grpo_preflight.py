"""Issue 35, finding 10, as a user meets it: ``python -m posttrain.grpo`` in its own process.

``--dry-run`` with an unknown task, a missing ``--model-path`` and a broken ``--resume`` says
so, one line per flag, exit 2, no exception class names; the same command without
``--dry-run`` refuses the same way before any rank or output directory exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _trainer(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.grpo", *argv],
        capture_output=True, text=True, timeout=90,
        env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"},
    )  # fmt: skip


@pytest.mark.parametrize("dry_run", [True, False])
def test_bad_inputs_are_refused_before_anything_starts(tmp_path: Path, dry_run: bool) -> None:
    broken = tmp_path / "ckpt" / "iter_0000003"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text("{}")
    (broken / "optim.pt").write_bytes(b"\x80\x04not a checkpoint")
    out = tmp_path / "out"
    argv = ["--task", "chess", "--model-path", str(tmp_path / "missing"),
            "--resume", str(broken), "--out-dir", str(out),
            # what a real run needs besides, so that the checks above are what refuses it
            "--rollout-url", "http://127.0.0.1:9", "--engine-urls", "http://127.0.0.1:9"]  # fmt: skip
    done = _trainer(*argv, *(["--dry-run"] if dry_run else []))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert [line.split()[1].rstrip(":") for line in lines] == ["--model-path", "--task", "--resume"]
    assert all(line.startswith("error: ") for line in lines)
    assert "manifest.json is missing" in lines[2]
    for name in ("Error:", "Traceback", "Exception"):
        assert name not in done.stderr
    assert "valid" not in done.stdout
    assert not out.exists()
