"""The parity command: self-spawning mode, torchrun mode, and its layout errors."""

from __future__ import annotations

import json
from pathlib import Path

import fsdp_mesh_workers as workers
import pytest

from posttrain.fsdp_mesh import parity
from posttrain.interface.testing import free_port, run_workers


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_self_spawning_command_passes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "reports" / "parity.json"  # the folder is made for it
    code = parity.main(
        ["--replicate", "1", "--shard", "2", "--steps", "1", "--start-method", "forkserver",
         "--json", str(path)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert out.rstrip().endswith("PASS r1s2")
    assert len(out.splitlines()) <= 8  # a summary for a person, not the JSON report
    assert "every check passed" in out
    assert f"full report (every rank): {path}" in out
    report = json.loads(path.read_text())
    assert report["passed"] is True
    assert report["layout"] == "r1s2"
    assert report["tolerance"] == {"rtol": 2e-5, "atol": 2e-6}
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["checkpoint_exact"] for r in report["ranks"])


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_torchrun_mode_uses_the_launched_ranks() -> None:
    argvs = [
        ["--replicate", "2", "--shard", "2"],
        ["--replicate", "2", "--shard", "1", "--steps", "1"],
    ]
    out = run_workers(
        workers.torchrun_main,
        2,
        timeout_s=150,
        backend=None,
        args=([free_port(), free_port()], argvs),
    )
    for rank, (mismatch, run) in enumerate(out):
        assert mismatch == (
            "MeshConfigError",
            "torchrun started 2 ranks but --replicate 2 x --shard 2 = 4",
        )
        assert run[0] == 0
        if rank == 0:
            assert run[1].rstrip().endswith("PASS r2s1")
        else:
            assert run[1] == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicate", "0", "--shard", "2"], "replicate must be a positive int, got 0"),
        (["--replicate", "2", "--shard", "-1"], "shard must be a positive int, got -1"),
        (
            ["--replicate", "1", "--shard", "2", "--steps", "0"],
            "steps must be a positive int, got 0",
        ),
        (
            ["--replicate", "1", "--shard", "2", "--timeout", "nan"],
            "--timeout must be a finite number of seconds > 0, got nan",
        ),
        (
            ["--replicate", "1", "--shard", "2", "--timeout", "-1"],
            "--timeout must be a finite number of seconds > 0, got -1.0",
        ),
    ],
)
def test_bad_layout_fails_before_any_process(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parity.main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_unwritable_json_path_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = parity.main(["--replicate", "1", "--shard", "2", "--json", str(blocker / "p.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("FAIL r1s2: --json ")
    assert str(blocker) in err
    assert "running" not in err  # no rank was started
