"""GrpoConfig: defaults, per-field validation naming the field, and what this build refuses."""

import math
from dataclasses import fields
from pathlib import Path

import pytest

from posttrain.grpo import GrpoConfig, GrpoConfigError, GrpoUnsupportedError
from posttrain.grpo.config import (
    HELP,
    field_default,
    literal_choices,
    parse_moe_layer_freq,
)
from posttrain.interface import ConfigError


def test_defaults_are_valid_and_supported() -> None:
    cfg = GrpoConfig()
    cfg.check_supported(world_size=2)
    assert cfg.world_size == 2
    assert cfg.lora_scaling == 2.0
    assert cfg.to_dict()["out_dir"] == "runs/grpo"


def test_every_field_has_help_and_a_default() -> None:
    names = [f.name for f in fields(GrpoConfig)]
    assert set(HELP) == set(names)
    assert all(HELP[n].strip() for n in names)
    assert field_default("lora_targets") == ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "deepspeed"}, "backend"),
        ({"kl_type": "k4"}, "kl_type"),
        ({"lora_r": 0}, "lora_r"),
        ({"lora_r": True}, "lora_r"),
        ({"shard": 0}, "shard"),
        ({"lr": math.nan}, "lr"),
        ({"lr": 0.0}, "lr"),
        ({"temperature": math.inf}, "temperature"),
        ({"rollout_timeout_s": math.inf}, "rollout_timeout_s"),
        ({"turn_timeout_s": math.inf}, "turn_timeout_s"),
        ({"turn_timeout_s": 0.0}, "turn_timeout_s"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"tis_clip_low": 2.0, "tis_clip_high": 2.0}, "tis_clip_low"),
        ({"rollout_url": "localhost:8000"}, "rollout_url"),
        ({"rollout_url": "http://h:notaport"}, "rollout_url"),
        ({"teacher_url": "http://t:1"}, "teacher_url"),
        ({"lora_targets": ()}, "lora_targets"),
        ({"lora_targets": "q_proj"}, "lora_targets"),
        ({"moe_layer_freq": (0, 2)}, "moe_layer_freq"),
        ({"moe_layer_freq": (0, 1), "num_layers": 3, "num_experts": 4}, "moe_layer_freq"),
        ({"moe_layer_freq": (0, 1)}, "num_experts"),
        ({"opd": "yes"}, "opd"),
        ({"compile": True}, "compile"),  # strict numerics (the default) are never compiled
        ({"compile": True, "numerics": "fast", "compile_mode": "fast"}, "compile_mode"),
        ({"numerics": "fast", "compile_mode": "reduce-overhead"}, "compile_mode"),  # no compile
    ],
)
def test_invalid_field_is_named(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(GrpoConfigError, match=field) as info:
        GrpoConfig(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ConfigError)


def test_full_training_needs_no_targets_and_paths_are_coerced() -> None:
    cfg = GrpoConfig(train="full", lora_targets=(), out_dir="o", model_path="m")  # type: ignore[arg-type]
    assert cfg.out_dir == Path("o")
    assert cfg.model_path == Path("m")


@pytest.mark.parametrize(
    ("kwargs", "option", "hint"),
    [
        ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size", "out of scope"),
        (
            {"backend": "megatron", "pipeline_model_parallel_size": 2},
            "pipeline_model_parallel_size",
            "out of scope",
        ),
        ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size", "--backend megatron"),
        ({"expert_model_parallel_size": 8}, "expert_model_parallel_size", "HSDP"),
        ({"sequence_parallel": True}, "sequence_parallel", "--backend megatron"),
        (
            {"backend": "megatron", "tensor_model_parallel_size": 4},
            "tensor_model_parallel_size",
            "does not divide the 2 trainer ranks",
        ),
        (
            {"backend": "megatron", "context_parallel_size": 2},
            "context_parallel_size",
            "fsdp backend only",
        ),
        ({"backend": "megatron", "numerics": "fast", "compile": True}, "compile", "drop --compile"),
    ],
)
def test_unsupported_is_refused_with_a_remedy(
    kwargs: dict[str, object], option: str, hint: str
) -> None:
    cfg = GrpoConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(GrpoUnsupportedError, match=hint) as info:
        cfg.check_supported()
    assert info.value.field == option


def test_world_size_must_match_the_started_ranks() -> None:
    with pytest.raises(GrpoUnsupportedError, match="WORLD_SIZE"):
        GrpoConfig(replicate=2, shard=2).check_supported(world_size=8)
    GrpoConfig(replicate=2, shard=4).check_supported(world_size=8)
    # megatron: torchrun's WORLD_SIZE is the world; tp and ep must divide it
    GrpoConfig(backend="megatron", tensor_model_parallel_size=4).check_supported(world_size=8)
    with pytest.raises(GrpoUnsupportedError, match="WORLD_SIZE"):
        GrpoConfig(backend="megatron", expert_model_parallel_size=3).check_supported(world_size=8)


def test_literal_choices() -> None:
    assert literal_choices("tis") == ("off", "tis", "icepop")
    assert literal_choices("lr") == ()


@pytest.mark.parametrize(
    ("text", "layers", "expected"),
    [
        ("[0]*1+[1]*3", None, (0, 1, 1, 1)),
        ("[1]*2", None, (1, 1)),
        ("[0, 1,1]", None, (0, 1, 1)),
        ("2", 5, (1, 0, 1, 0, 1)),
    ],
)
def test_parse_moe_layer_freq(text: str, layers: int | None, expected: tuple[int, ...]) -> None:
    assert parse_moe_layer_freq(text, num_layers=layers) == expected


@pytest.mark.parametrize("text", ["[2]*3", "__import__('os')", "[]", "3", "0", "[0]*1+x"])
def test_parse_moe_layer_freq_refuses(text: str) -> None:
    with pytest.raises(GrpoConfigError, match="moe_layer_freq"):
        parse_moe_layer_freq(text)


def test_the_api_key_comes_from_a_file_and_a_bad_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POSTTRAIN_API_KEY", raising=False)
    assert GrpoConfig().api_key() is None
    monkeypatch.setenv("POSTTRAIN_API_KEY", "from-env")
    assert GrpoConfig().api_key() == "from-env"  # the environment, when no file is given
    key = tmp_path / "stack.key"
    key.write_text("f00d\n")
    assert GrpoConfig(api_key_file=str(key)).api_key() == "f00d"  # type: ignore[arg-type]
    for content in ("", "two words\n"):
        key.write_text(content)
        with pytest.raises(GrpoConfigError, match="must hold exactly one token") as info:
            GrpoConfig(api_key_file=key).api_key()
        assert info.value.field == "api_key_file"
    with pytest.raises(GrpoConfigError, match="cannot be read"):
        GrpoConfig(api_key_file=tmp_path / "missing.key").api_key()


@pytest.mark.parametrize("name", [f.name for f in fields(GrpoConfig) if f.type == "bool"])
def test_every_bool_field_refuses_a_string(name: str) -> None:
    with pytest.raises(GrpoConfigError, match=rf"{name} must be a bool, got 'false'"):
        GrpoConfig(**{name: "false"})  # type: ignore[arg-type]


def test_compile_modes_are_the_models_compile_modes() -> None:
    """``GrpoConfig.compile_mode`` passes straight to ``posttrain.models.compile_layers``."""
    from typing import get_args

    from posttrain.grpo.config import CompileMode
    from posttrain.models import COMPILE_MODES

    assert get_args(CompileMode) == COMPILE_MODES
