"""The model gate at ``--dry-run``: an unsupported checkpoint fails in a second, by name."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from posttrain.grpo import GrpoConfig, GrpoConfigError
from posttrain.grpo.cli import main
from posttrain.grpo.model_check import check_model, resolve_model_paths
from posttrain.models import ModelConfig
from posttrain.models.testing import hf_config


def write_config(path: Path, cls: str, arch: str, **extra: object) -> Path:
    hf_config(cls, arch, **extra).save_pretrained(str(path))
    return path


def error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main([*argv, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("cls", "arch", "extra", "feature"),
    [
        ("Gemma2Config", "Gemma2ForCausalLM", {}, "soft-capping"),
        ("DeepseekV2Config", "DeepseekV2ForCausalLM", {"kv_lora_rank": 16}, "DeepSeek-V2"),
        (
            "Qwen3Config",
            "Qwen3ForCausalLM",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type='dynamic'",
        ),
    ],
)
def test_dry_run_refuses_an_unsupported_model_by_name(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cls: str,
    arch: str,
    extra: dict[str, object],
    feature: str,
) -> None:
    ckpt = write_config(tmp_path, cls, arch, **extra)
    start = time.monotonic()
    line = error_line(capsys, "--model-path", str(ckpt))
    assert time.monotonic() - start < 30  # no stack started (a generous bound on a busy box)
    assert arch in line
    assert feature in line
    assert "--model-path" in line


def test_dry_run_accepts_each_supported_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for cls, arch in (
        ("LlamaConfig", "LlamaForCausalLM"),
        ("Qwen2Config", "Qwen2ForCausalLM"),
        ("MistralConfig", "MistralForCausalLM"),
        ("Qwen3Config", "Qwen3ForCausalLM"),
    ):
        ckpt = write_config(tmp_path / arch, cls, arch)
        code = main(["--model-path", str(ckpt), "--context-length", "32", "--dry-run"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert "the config is valid" in out


def test_lora_targets_must_exist_in_the_architecture(tmp_path: Path) -> None:
    ckpt = write_config(tmp_path, "LlamaConfig", "LlamaForCausalLM")
    check_model(GrpoConfig(model_path=ckpt, lora_targets=("q_proj", "gate_proj")))
    with pytest.raises(GrpoConfigError, match=r"--lora-targets gate: no such linear") as err:
        check_model(GrpoConfig(model_path=ckpt, lora_targets=("q_proj", "gate")))
    assert err.value.field == "lora_targets"


# GLM-4.7-Flash's layout at test size: MLA (kv heads = heads), a dense layer, then experts
_GLM = {"num_key_value_heads": 4, "head_dim": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16}  # fmt: skip


def test_mla_models_pass_the_gate_with_their_own_lora_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_config(tmp_path, "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", **_GLM)
    mla = "q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj"
    code = main(["--model-path", str(ckpt), "--lora-targets", mla, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "the config is valid" in out
    line = error_line(capsys, "--model-path", str(ckpt))  # the default q/k/v/o targets
    assert "--lora-targets q_proj,k_proj,v_proj: no such linear" in line
    assert "kv_b_proj" in line


def test_megatron_takes_mla_under_tensor_expert_and_sequence_parallel(tmp_path: Path) -> None:
    # the parity of these layouts: test_grpo_megatron_mla*.py; the gate lets them through
    ckpt = write_config(tmp_path, "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", **_GLM)
    base = {"model_path": ckpt, "train": "full", "backend": "megatron", "shard": 2}
    for layout in (
        {"tensor_model_parallel_size": 2},
        {"expert_model_parallel_size": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    ):
        check_model(GrpoConfig(**base, **layout))  # type: ignore[arg-type]


def test_megatron_refuses_qkv_biases(tmp_path: Path) -> None:
    ckpt = write_config(tmp_path, "Qwen2Config", "Qwen2ForCausalLM")
    check_model(GrpoConfig(model_path=ckpt))
    with pytest.raises(GrpoConfigError, match="q/k/v biases") as err:
        check_model(GrpoConfig(model_path=ckpt, backend="megatron", shard=1))
    assert err.value.field == "backend"


def test_a_hub_id_comes_from_the_local_cache_or_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    cfg = ModelConfig.tiny(
        num_experts=0, mlp_only_layers=(), family="qwen2", qk_norm=False, qkv_bias=True
    )
    (repo / "snapshots" / "abc" / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    config = GrpoConfig(model_path=Path("acme/tiny"))
    check_model(config)
    assert resolve_model_paths(config).model_path == repo / "snapshots" / "abc"
    line = error_line(capsys, "--model-path", "acme/not-cached")
    assert "hf download acme/not-cached" in line
