"""The trainer command ``python -m posttrain.grpo``: parsing, dry run, refusals, exit codes."""

import json
import os
import subprocess
import sys
import types
from dataclasses import fields
from pathlib import Path

import pytest

from posttrain.grpo import GrpoConfig, GrpoConfigError, GrpoUnsupportedError
from posttrain.grpo._shape import check_declared_shape
from posttrain.grpo.cli import build_config, main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    return lines[0]


def test_dry_run_prints_the_resolved_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from posttrain.models import ModelConfig

    ckpt = write_hf_config(tmp_path, **ModelConfig.tiny().to_hf_dict())
    code, out, _ = run_cli(capsys, "--dry-run", "--model-path", str(ckpt), "--lr", "3e-6")
    assert code == 0
    assert "the config is valid; nothing was started" in out
    assert "* --lr" in out
    assert "3e-06" in out
    assert "  --backend" in out  # unchanged fields are not starred


def test_json_dry_run_is_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--dry-run", "--json", "--lr", "1e-6", "--lr=2e-6", "--bf16")
    assert code == 0
    got = json.loads(out)
    want = GrpoConfig(lr=2e-6, precision="bf16", dry_run=True).to_dict()
    assert got == want  # the last --lr wins, as in argparse


def test_launch_style_argv(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model-path", "Qwen/Qwen3-8B", "--rollout-url", "http://10.0.0.1:8100",
        "--backend", "fsdp", "--replicate", "2", "--shard", "8", "--bf16",
        "--lora-targets", "q_proj, v_proj", "--teacher-url", "http://10.0.0.2:30000",
        "--no-std-normalize", "--dry-run", "--json", "--no-model-check",
    ]  # fmt: skip
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    got = json.loads(out)
    assert got["lora_targets"] == ["q_proj", "v_proj"]
    assert got["opd"] is True  # --teacher-url implies --opd
    assert got["std_normalize"] is False
    assert (got["replicate"], got["shard"], got["precision"]) == (2, 8, "bf16")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--backend", "megatron", "--pipeline-model-parallel-size", "2"],
            "is out of scope of this build",
        ),
        (
            ["--backend", "megatron", "--tensor-model-parallel-size", "3"],
            "--tensor-model-parallel-size: tensor_model_parallel_size=3 does not divide the 2",
        ),
        (["--backend", "megatron", "--context-parallel-size", "2"], "fsdp backend only"),
        (["--sequence-parallel"], "needs --backend megatron"),
        (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size"),
        (["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size"),
        (["--expert-model-parallel-size", "8"], "--expert-model-parallel-size"),
        (
            ["--fp8-format", "e4m3"],
            "--fp8-format e4m3: fp8 training needs Transformer Engine's low-precision linears",
        ),
        (["--fp8-recipe", "blockwise"], "--fp8-recipe blockwise"),
        (["--fp4-recipe", "nvfp4"], "--rollout-quant nvfp4"),
        (["--fp16"], "--fp16"),
        (["--precision", "fp32", "--bf16"], "--bf16 contradicts --precision fp32"),
        (["--lr", "nan"], "--lr: lr=nan must be finite"),
        (["--dual-clip", "0.5"], "--dual-clip"),
        (["--rollout-url", "localhost:8100"], "--rollout-url"),
        (["--moe-layer-freq", "eval('1')"], "--moe-layer-freq"),
        (["--bogus", "1"], "No such option: --bogus"),
        (["--steps", "1.5"], "'--steps'"),
        (["--kl-type", "k9"], "'--kl-type'"),
        (["--numerics", "fast", "--compile", "--compile-mode", "graphs"], "'--compile-mode'"),
        (["--numerics", "fast", "--compile-mode", "reduce-overhead"], "--compile-mode"),
    ],
)
def test_refusals_are_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = run_cli(capsys, *argv, "--dry-run")
    assert code == 2
    assert out == ""
    assert needle in one_error_line(err)


def test_world_size_from_torchrun_must_match() -> None:
    values = {"replicate": 2, "shard": 4}
    assert build_config(values, environ={"WORLD_SIZE": "8"}).world_size == 8
    with pytest.raises(GrpoUnsupportedError, match="WORLD_SIZE"):
        build_config(values, environ={"WORLD_SIZE": "4"})
    with pytest.raises(GrpoConfigError, match="WORLD_SIZE"):
        build_config(values, environ={"WORLD_SIZE": "four"})


def test_without_dry_run_the_loop_gets_the_config(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[GrpoConfig] = []
    stand_in = types.ModuleType("posttrain.grpo.loop")
    stand_in.run = seen.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "posttrain.grpo.loop", stand_in)
    code, _, _ = run_cli(capsys, "--steps", "3", "--seed", "7")
    assert code == 0
    assert [(c.steps, c.seed, c.dry_run) for c in seen] == [(3, 7, False)]


def test_an_unexpected_error_is_one_line_with_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(config: GrpoConfig) -> None:
        raise RuntimeError("loop bug")

    stand_in = types.ModuleType("posttrain.grpo.loop")
    stand_in.run = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "posttrain.grpo.loop", stand_in)
    monkeypatch.delenv("POSTTRAIN_TRACEBACK", raising=False)
    code, _, err = run_cli(capsys)
    assert code == 1
    assert "internal error RuntimeError: loop bug" in one_error_line(err)


def test_help_lists_every_field_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    flat = " ".join(out.split())
    for f in fields(GrpoConfig):
        assert "--" + f.name.replace("_", "-") in flat, f.name
    for shown in ("[default: 20]", "[default: fsdp]", "[default: 0.2]", "q_proj,k_proj"):
        assert shown in flat
    assert "--precision bf16 [default: fp32]" in flat
    assert "[default: (" not in flat  # click's parenthesised custom default
    for extra in ("--bf16", "--json", "--fp8-recipe", "--fp4-format"):
        assert extra in flat


def write_hf_config(path: Path, **entries: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(entries))
    return path


def test_declared_shape_is_checked_against_the_checkpoint(tmp_path: Path) -> None:
    qwen = write_hf_config(
        tmp_path / "qwen", num_hidden_layers=4, num_experts=8, decoder_sparse_step=1,
        mlp_only_layers=[0],
    )  # fmt: skip
    ok = GrpoConfig(model_path=qwen, num_layers=4, num_experts=8, moe_layer_freq=(0, 1, 1, 1))
    assert check_declared_shape(ok) is True
    for bad, field in (
        ({"num_layers": 5}, "num_layers"),
        ({"num_experts": 4}, "num_experts"),
        ({"moe_layer_freq": (1, 1, 1, 1), "num_experts": 8}, "moe_layer_freq"),
    ):
        with pytest.raises(GrpoConfigError, match=field):
            check_declared_shape(GrpoConfig(model_path=qwen, **bad))  # type: ignore[arg-type]
    glm = write_hf_config(
        tmp_path / "glm", num_hidden_layers=3, n_routed_experts=4, first_k_dense_replace=1
    )
    assert check_declared_shape(GrpoConfig(model_path=glm, moe_layer_freq=(0, 1, 1), num_experts=4))
    dense = write_hf_config(tmp_path / "dense", num_hidden_layers=2)
    with pytest.raises(GrpoConfigError, match="num_experts"):
        check_declared_shape(GrpoConfig(model_path=dense, num_experts=2))
    # A hub id (no local config.json) cannot be checked here: the loop loads it.
    assert check_declared_shape(GrpoConfig(model_path=Path("Org/Model"), num_layers=3)) is False


def test_cli_checks_the_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_hf_config(tmp_path, num_hidden_layers=2, num_experts=4)
    code, _, err = run_cli(capsys, "--model-path", str(ckpt), "--num-layers", "3", "--dry-run")
    assert code == 2
    assert "num_hidden_layers=2" in one_error_line(err)


def test_module_entry_point_exits_2_without_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.grpo", "--pipeline-model-parallel-size", "4",
         "--dry-run"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "pipeline parallelism" in one_error_line(proc.stderr)


def test_megatron_flags_pass_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--backend", "megatron", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-model-parallel-size", "4", "--bf16", "--json", "--dry-run"]  # fmt: skip
    os.environ["WORLD_SIZE"] = "8"
    try:
        code, out, _ = run_cli(capsys, *argv)
    finally:
        del os.environ["WORLD_SIZE"]
    assert code == 0
    got = json.loads(out)
    assert (got["backend"], got["tensor_model_parallel_size"], got["sequence_parallel"]) == (
        "megatron",
        2,
        True,
    )
    assert got["expert_model_parallel_size"] == 4
