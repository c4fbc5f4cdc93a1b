"""Specs validate themselves: every invalid combination raises before anything is built."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.interface import (
    ConfigError,
    FourOverSix,
    LoraSpec,
    MeshAxis,
    MeshSpec,
    NVFP4Precision,
    ScaleRounding,
)


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(min_value=-2, max_value=64),
    replicate=st.integers(min_value=-2, max_value=64),
    shard=st.one_of(st.none(), st.integers(min_value=-2, max_value=64)),
)
def test_mesh_spec_accepts_exactly_the_covering_layouts(
    world: int, replicate: int, shard: int | None
) -> None:
    valid = (
        world >= 1
        and replicate >= 1
        and world % replicate == 0
        and (shard is None or shard == world // replicate)
    )
    if not valid:
        with pytest.raises(ConfigError) as info:
            MeshSpec(world_size=world, replicate=replicate, shard=shard)
        message = str(info.value)
        assert any(str(n) in message for n in (world, replicate, shard) if n is not None)
        return
    spec = MeshSpec(world_size=world, replicate=replicate, shard=shard)
    r, s = spec.shape
    assert r * s == world
    covered = sorted(rank for i in range(r) for rank in spec.shard_group_ranks(i))
    assert covered == list(range(world))
    covered = sorted(rank for j in range(s) for rank in spec.replicate_group_ranks(j))
    assert covered == list(range(world))
    for rank in range(world):
        i, j = spec.coords(rank)
        assert rank in spec.shard_group_ranks(i)
        assert rank in spec.replicate_group_ranks(j)
        assert (i, j) == (rank // s, rank % s)


def test_mesh_spec_names_and_errors() -> None:
    spec = MeshSpec(world_size=4, replicate=2)
    assert spec.axis_names == (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD)
    assert spec.shard_group_ranks(1) == [2, 3]
    assert spec.replicate_group_ranks(1) == [1, 3]
    with pytest.raises(ConfigError, match="replicate 2 x shard 3 = 6 does not cover world_size 4"):
        MeshSpec(world_size=4, replicate=2, shard=3)
    with pytest.raises(ConfigError, match="not divisible by replicate 3"):
        MeshSpec(world_size=4, replicate=3)
    with pytest.raises(ConfigError, match="device_type 'tpu'"):
        MeshSpec(world_size=2, device_type="tpu")
    with pytest.raises(ConfigError, match="rank 4 is outside world_size 4"):
        spec.coords(4)
    with pytest.raises(ConfigError, match="world_size must be an int"):
        MeshSpec(world_size=True)


def test_lora_spec_scaling_and_errors() -> None:
    assert LoraSpec(r=8, alpha=16, target_modules=("q_proj",)).scaling == 2.0
    rs = LoraSpec(r=16, alpha=16, target_modules=["q_proj"], use_rslora=True)
    assert rs.scaling == 4.0
    assert rs.target_modules == ("q_proj",)
    for kwargs, field in [
        ({"r": 0}, "LoraSpec.r"),
        ({"alpha": -1.0}, "LoraSpec.alpha"),
        ({"alpha": math.nan}, "LoraSpec.alpha"),
        ({"target_modules": ()}, "target_modules"),
        ({"target_modules": "q_proj"}, "target_modules"),
        ({"dropout": 1.0}, "LoraSpec.dropout"),
    ]:
        base: dict[str, object] = {"r": 4, "alpha": 8.0, "target_modules": ("q_proj",)}
        base.update(kwargs)
        with pytest.raises(ConfigError, match=field):
            LoraSpec(**base)  # type: ignore[arg-type]


def test_nvfp4_precision() -> None:
    precision = NVFP4Precision(four_over_six="mse", scale_rounding="te-divide")  # type: ignore[arg-type]
    assert precision.four_over_six is FourOverSix.MSE
    assert precision.scale_rounding is ScaleRounding.TE_DIVIDE
    with pytest.raises(ConfigError, match="group_size must be 16, got 32"):
        NVFP4Precision(group_size=32)
    with pytest.raises(ConfigError, match="four_over_six"):
        NVFP4Precision(four_over_six="max")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="input_scale"):
        NVFP4Precision(input_scale=0.0)
    with pytest.raises(ConfigError, match="kv_cache_quant_algo"):
        NVFP4Precision(kv_cache_quant_algo="FP4")  # type: ignore[arg-type]
    assert NVFP4Precision(input_scale=None, kv_cache_quant_algo=None).input_scale is None
