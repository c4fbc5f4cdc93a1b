"""Issue 35, finding 10: ``--dry-run`` runs every check the run makes before it starts a
process, and a real run runs them first too; each failure one line naming its flag, exit 2,
no raw exception names."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from grpo_workers import save_tiny_checkpoint
from safetensors.torch import save_file

from posttrain.fsdp_mesh import write_manifest
from posttrain.grpo import GrpoConfig
from posttrain.grpo.cli import main
from posttrain.grpo.preflight import CHECKS, Check, PreflightError, register, run_preflight

RAW_NAMES = ("NotADirectoryError", "FileNotFoundError", "SafetensorError", "Traceback",
             "PermissionError", "IsADirectoryError")  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny_checkpoint(tmp_path_factory.mktemp("pf") / "tiny", max_positions=64))


def _errors(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    code = main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == (2 if lines else 0), (code, out, err)
    for line in lines:
        assert line.startswith("error: --"), line
        assert not any(name in line for name in RAW_NAMES), line
    return lines


def _resume_ckpt(root: Path, *, value: float) -> Path:
    path = root / "iter_0000001"
    (path / "adapter").mkdir(parents=True)
    save_file({"w": torch.full((2, 2), value)}, str(path / "adapter" / "adapter_model.safetensors"))
    meta = {"step": 1, "world_size": 1, "replicate": 1, "shard": 1, "torch_version": "x",
            "timestamp": time.time(), "extra": {"next_step": 2, "data_position": 0}}  # fmt: skip
    (path / "meta.json").write_text(json.dumps(meta))
    write_manifest(path)
    return path


def test_a_valid_config_passes(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _resume_ckpt(tmp_path / "ok", value=0.5)
    assert _errors(capsys, "--model-path", str(tiny), "--out-dir", str(tmp_path / "out"),
                   "--resume", str(good)) == []  # fmt: skip
    assert not (tmp_path / "out").exists()  # probed, not created


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--task", "chess"], "--task", "not one of addition, shapes"),
        (
            ["--model-path", "/no/such/model"],
            "--model-path",
            "neither a local directory nor a hub id",
        ),
        (["--model-path", "{file}"], "--model-path", "is a file"),
        (["--model-path", "{empty}"], "--model-path", "config.json does not exist"),
        (["--out-dir", "{file}/out"], "--out-dir", "is a file"),
        (
            ["--out-dir", "/proc/no-such-run"],
            "--out-dir",
            "/proc/no-such-run: cannot write in /proc",
        ),
        (["--resume", "{empty}"], "--resume", "no checkpoint there"),
        (["--resume", "{nan}"], "--resume", "non-finite"),
        (["--resume", "{huge}"], "--resume", "magnitude"),
        (["--resume", "{old}"], "--resume", "manifest.json is missing"),
        (["--api-key-file", "/no/such/key"], "--api-key-file", "cannot be read"),
    ],
)
def test_each_bad_input_is_one_line_naming_its_flag(
    args: list[str], flag: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    old = _resume_ckpt(tmp_path / "old", value=0.5)
    (old / "manifest.json").unlink()
    places = {"file": tmp_path / "file", "empty": tmp_path / "empty", "old": old,
              "nan": _resume_ckpt(tmp_path / "nan", value=math.nan),
              "huge": _resume_ckpt(tmp_path / "huge", value=8.4e37)}  # fmt: skip
    argv = [a.format(**places) for a in args]
    lines = (
        _errors(capsys, *argv, "--out-dir", str(tmp_path / "out"))
        if flag != "--out-dir"
        else _errors(capsys, *argv)
    )
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {flag}"), lines
    assert words in lines[0], lines


def test_every_failure_is_reported_not_only_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _errors(capsys, "--task", "chess", "--model-path", "/no/such/model",
                    "--resume", str(tmp_path))  # fmt: skip
    assert len(lines) == 3, lines
    assert {line.split()[1].rstrip(":") for line in lines} == {"--model-path", "--task", "--resume"}


def test_a_real_run_runs_the_checks_before_anything_starts(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --dry-run the broken resume is refused before any process starts."""
    code = main(["--model-path", str(tiny), "--rollout-url", "http://127.0.0.1:9",
                 "--engine-urls", "http://127.0.0.1:9", "--resume", str(tmp_path),
                 "--out-dir", str(tmp_path / "out")])  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("error: --resume"), err
    assert not (tmp_path / "out").exists()


def _torchrun_rank(
    rank: int, world: int, tiny: Path, resumes: list[Path], out: Path, seen: Path
) -> tuple[str, tuple[str, ...]]:
    """One rank of a torchrun job (``RANK`` set, no process group yet) calling ``loop.run``
    with its own view of ``--resume``; a check appended here records which ranks run checks."""
    from posttrain.grpo import loop

    def record(cfg: GrpoConfig) -> None:
        with seen.open("a") as f:
            f.write(f"{rank}\n")

    CHECKS.append(Check("rank", "--out-dir", record))  # this forked rank's list only
    cfg = GrpoConfig(model_path=tiny, rollout_url="http://127.0.0.1:9",
                     engine_urls=("http://127.0.0.1:9",), out_dir=out, resume=resumes[rank],
                     replicate=1, shard=world)  # fmt: skip
    try:
        loop.run(cfg)
    except PreflightError as exc:
        return type(exc).__name__, exc.failures
    return "ran", ()


def test_under_torchrun_rank_0_checks_and_every_rank_raises_its_error(
    tiny: Path, tmp_path: Path
) -> None:
    """The resume checkpoint is broken on rank 0's view only: rank 0 alone runs the checks,
    and both ranks raise the same PreflightError, its message included."""
    from posttrain.interface.processes import run_workers

    broken = _resume_ckpt(tmp_path / "broken", value=math.nan)
    good = _resume_ckpt(tmp_path / "good", value=0.5)
    seen = tmp_path / "seen.txt"
    results = run_workers(_torchrun_rank, 2, args=(tiny, [broken, good], tmp_path / "out", seen),
                          backend=None, timeout_s=120)  # fmt: skip
    assert results[0] == results[1]
    name, failures = results[0]
    assert name == "PreflightError"
    assert len(failures) == 1
    assert failures[0].startswith("--resume"), failures
    assert "non-finite" in failures[0], failures
    assert seen.read_text().split() == ["0"]  # rank 1 ran no check
    assert not (tmp_path / "out").exists()


def test_a_check_is_registered_with_one_call() -> None:
    seen: list[str] = []

    def needs_reward(cfg: GrpoConfig) -> None:
        seen.append(cfg.task)
        raise ValueError("no reward for it")

    check = register(Check("reward", "--task", needs_reward))
    try:
        with pytest.raises(PreflightError) as info:
            run_preflight(GrpoConfig(), checks=[check])
        assert info.value.failures == ("--task: no reward for it",)
        assert seen == ["addition"]
        assert CHECKS[-1] is check
    finally:
        CHECKS.remove(check)
