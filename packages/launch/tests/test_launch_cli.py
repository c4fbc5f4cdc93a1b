"""The ``posttrain`` CLI, exactly as spelled in the issue: plan, up (dry run), hardware."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.launch import Plan
from posttrain.launch.cli import app

GOLDEN = Path(__file__).parent / "golden"
runner = CliRunner()


def test_plan_json_is_the_golden_plan() -> None:
    result = runner.invoke(
        app, ["plan", "--model", "glm-4.7-flash", "--hardware", "b200", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == (GOLDEN / "glm-4.7-flash__b200.json").read_text()
    Plan.from_json(result.stdout)


def test_plan_attention_backend_escape_hatch() -> None:
    result = runner.invoke(
        app,
        ["plan", "--model", "glm-4.7-flash", "--hardware", "b200", "--attention-backend", "fa3", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == (GOLDEN / "glm-4.7-flash__b200__attention-fa3.json").read_text()


def test_plan_text_shows_commands_and_explanation() -> None:
    result = runner.invoke(
        app,
        ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h200",
         "--engine-arg", "--mem-fraction-static 0.7", "--trainer-arg=--lr=1e-6"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "python -m sglang.launch_server" in result.stdout
    assert "--mem-fraction-static 0.7" in result.stdout
    assert (
        "--bf16  <- precision (bf16; the fp8-blockwise recipe needs Transformer Engine, which "
        "the trainer backends do not use)" in result.stdout
    )
    assert "--lr: user adds" in result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "glm-4.7-flash", "--hardware", "cpu"], "(cpu, 1 node(s))"),
        (["--model", "glm-4.7-flash", "--hardware", "h200", "--nodes", "3"], "(h200, 3 node(s))"),
        (["--model", "gpt-5", "--hardware", "h200"], "model 'gpt-5' is not one of"),
        (["--model", "qwen3-8b", "--hardware", "a100"], "hardware 'a100' is not one of"),
        (["--model", "qwen3-8b", "--hardware", "h200", "--precision", "nvfp4"], "precision=nvfp4"),
        (
            ["--model", "qwen3-8b", "--hardware", "b200", "--precision", "mxfp8"],
            "Transformer Engine",
        ),
        (["--model", "qwen3-8b", "--hardware", "h200", "--precision", "fp3"], "'fp3' is not one"),
    ],
)
def test_plan_errors_exit_2_with_one_line(argv: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *argv])
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_hardware_json_reports_declared_and_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi / rocm-smi: a CPU machine
    monkeypatch.setenv("POSTTRAIN_HARDWARE", "h200")
    result = runner.invoke(app, ["hardware", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["declared"] == "h200"
    assert report["detected"] == "cpu"
    assert report["gpu_names"] == []
    assert "declared hardware h200" in report["warnings"][0]


def test_hardware_table_lists_every_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("POSTTRAIN_HARDWARE", raising=False)
    result = runner.invoke(app, ["hardware"])
    assert result.exit_code == 0, result.output
    for name in ("h100", "h200", "b200", "b300", "gb200", "gb300", "mi300x", "mi355x", "cpu"):
        assert name in result.stdout


def test_up_dry_run_shows_the_local_stack() -> None:
    result = runner.invoke(
        app,
        ["up", "--model-path", "/ckpt/tiny", "--engines", "2", "--lora", "policy=/ckpt/a",
         "--engine", "local-engine", "--dry-run"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.count("python -m posttrain.local_engine --model-path /ckpt/tiny") == 2
    assert "--lora-paths policy=/ckpt/a" in out
    assert "python -m posttrain.launch.sgl_router --host 127.0.0.1" in out
    assert "--policy manual --assignment-mode min_load" in out
    assert "python -m posttrain.session_router --upstream http://127.0.0.1:" in out
    assert "--lora-adapter policy" in out
    assert out.count("# after stage 1: POST http://127.0.0.1:") == 2


def test_up_rejects_two_adapters_and_bad_assignments() -> None:
    two = ["up", "--model-path", "/m", "--lora", "a=/x", "--lora", "b=/y", "--dry-run"]
    result = runner.invoke(app, two)
    assert result.exit_code == 2
    assert "2 adapters (a, b)" in result.stderr
    result = runner.invoke(app, ["up", "--model-path", "/m", "--lora", "nope", "--dry-run"])
    assert result.exit_code == 2
    assert "--lora 'nope' must be NAME=VALUE" in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_up_refuses_a_ready_timeout_that_is_not_finite_and_positive(value: str) -> None:
    args = ["up", "--model-path", "/m", "--ready-timeout-s", value, "--dry-run"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "--ready-timeout-s" in result.stderr
    assert "must be a finite number of seconds > 0" in result.stderr


def test_plan_names_an_extra_argument_with_an_unclosed_quote() -> None:
    args = ["plan", "--model", "qwen3-8b", "--hardware", "h100", "--engine-arg", '"unclosed']
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stderr == "error: --engine-arg '\"unclosed': No closing quotation\n"


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_model_path_that_is_not_a_directory_is_refused_before_any_process(
    command: str, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-checkpoint"
    result = runner.invoke(app, [command, "--model-path", str(missing)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: --model-path {missing}: no such directory (nor a hub id org/name)\n"
    )
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    result = runner.invoke(app, [command, "--model-path", str(a_file)])
    assert result.exit_code == 2
    assert "not a directory" in result.stderr


def test_run_dry_prints_a_saved_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text((GOLDEN / "qwen3-235b-a22b__h200__4n.json").read_text())
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("python -m torch.distributed.run --nnodes 2") == 2
    assert "after stage 1: register http://{node_ip:1}:30001" in result.stdout
    bad = runner.invoke(app, ["run", str(path), "--runner", "slurm"])
    assert bad.exit_code == 2
    assert "'slurm' is not one of dry, local, ray" in bad.stderr


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "No such file or directory"),
        ("garbage", "not JSON: Expecting value: line 1 column 1"),
        ("[1]", "a plan is a JSON object, got list"),
        ('{"x": 1}', "missing field 'name'"),
        ('{"name": "p", "hardware": "cpu", "nodes": "two", "processes": []}', "malformed field"),
    ],
)
def test_run_names_the_plan_file_at_fault(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: plan file {path}: ")
    assert expected in result.stderr
    assert "Traceback" not in result.output


def test_run_refuses_an_unknown_ray_strategy_before_reading_the_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    args = ["run", str(path), "--runner", "ray", "--ray-strategy", "FOO"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "--ray-strategy 'FOO' is not one of SPREAD, STRICT_SPREAD, PACK" in result.stderr


COMMANDS = ("plan", "up", "grpo", "demo", "hardware", "run")


def test_the_help_checks_cover_every_command() -> None:
    import typer.main

    assert set(typer.main.get_command(app).commands) == set(COMMANDS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_no_type_column(command: str) -> None:
    import typer.main

    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    for param in click_command.params:
        assert getattr(param, "help", None), f"{command} {param.name} has no help"
    result = runner.invoke(app, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0
    assert "<bool>" not in result.output
    assert "<int" not in result.output


def test_a_missing_sibling_package_is_one_line_naming_what_to_install(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import typer

    from posttrain.launch._console import require

    require("posttrain up", ["posttrain.launch", "posttrain.formats"])  # both here: no error
    with pytest.raises(typer.Exit) as exit_info:
        require("posttrain up", ["posttrain.launch", "posttrain.no_such_package", "sglang_rooter"])
    assert exit_info.value.exit_code == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        "error: posttrain up needs posttrain.no_such_package, sglang_rooter, not installed "
        "here; from the root of a clone: pip install posttrain.no_such_package sglang_rooter"
    )
