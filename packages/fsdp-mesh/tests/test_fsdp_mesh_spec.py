"""Pure checks: the (replicate, shard) layout and every validation error (no process group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.fsdp_mesh import (
    AccumulationError,
    CheckpointError,
    HsdpConfig,
    MeshBuildError,
    MeshConfigError,
    ParityConfig,
    accumulate_gradients,
    build_fsdp_mesh,
    check_device_type,
    checkpoint_dir,
    clip_grad_norm,
    grad_norm,
    latest_step,
    read_meta,
    scale_grads_to_norm,
)
from posttrain.interface import ConfigError, PosttrainError
from posttrain.interface import MeshSpec as Spec


@st.composite
def layouts(draw: st.DrawFn) -> Spec:
    w = draw(st.integers(1, 64))
    r = draw(st.sampled_from([d for d in range(1, w + 1) if w % d == 0]))
    return Spec(world_size=w, replicate=r)


@settings(max_examples=25, deadline=None)
@given(layouts())
def test_layout_is_a_grid_of_contiguous_shard_groups(spec: Spec) -> None:
    w, r, s = spec.world_size, spec.replicate, spec.shard_size
    coords = [spec.coords(g) for g in range(w)]
    assert sorted(coords) == [(i, j) for i in range(r) for j in range(s)]
    assert all(spec.coords(g) == (g // s, g % s) for g in range(w))
    shard_groups = [spec.shard_group_ranks(i) for i in range(r)]
    rep_groups = [spec.replicate_group_ranks(j) for j in range(s)]
    assert sorted(g for grp in shard_groups for g in grp) == list(range(w))
    assert sorted(g for grp in rep_groups for g in grp) == list(range(w))
    for i, grp in enumerate(shard_groups):
        assert list(grp) == list(range(i * s, i * s + s))
    for grp_a in shard_groups:
        for grp_b in rep_groups:
            assert len(set(grp_a) & set(grp_b)) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "replicate": 0}, r"replicate must be an int >= 1, got 0"),
        ({"world_size": 0, "replicate": 1}, r"world_size must be an int >= 1, got 0"),
        ({"world_size": 4, "replicate": 2, "shard": 0}, r"shard must be an int >= 1, got 0"),
        ({"world_size": 4, "replicate": 3}, r"world_size 4 is not divisible by replicate 3"),
        (
            {"world_size": 8, "replicate": 2, "shard": 2},
            r"replicate 2 x shard 2 = 4 does not cover world_size 8",
        ),
        (
            {"world_size": 2, "replicate": 1, "device_type": "tpu"},
            r"device_type 'tpu' is not one of",
        ),
    ],
)
def test_spec_errors_name_the_numbers(kwargs: dict[str, object], message: str) -> None:
    # MeshSpec is the interface's; these are the layout errors build_fsdp_mesh relies on.
    with pytest.raises(ConfigError, match=message) as info:
        Spec(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, PosttrainError)


@pytest.mark.parametrize(
    ("device_type", "message"),
    [
        ("nonsense", r"'nonsense' is not a torch device type"),
        ("cpu:0", r"bare type like 'cuda', got 'cpu:0'"),
        ("meta", r"'meta' cannot run collectives"),
    ],
)
def test_device_type_errors(device_type: str, message: str) -> None:
    with pytest.raises(MeshConfigError, match=message):
        check_device_type(device_type)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_unavailable_device_type_is_rejected_before_any_group() -> None:
    with pytest.raises(MeshConfigError, match=r"'cuda' is not available on this host"):
        build_fsdp_mesh(Spec(world_size=1, replicate=1, shard=1, device_type="cuda"))


def test_build_needs_an_initialized_group_and_a_known_method() -> None:
    spec = Spec(world_size=2, replicate=1, shard=2)
    with pytest.raises(MeshBuildError, match=r"torch\.distributed is not initialized"):
        build_fsdp_mesh(spec)
    with pytest.raises(MeshConfigError, match="method must be"):
        build_fsdp_mesh(spec, method="magic")  # type: ignore[arg-type]


def test_option_errors() -> None:
    with pytest.raises(
        MeshConfigError, match=r"param_dtype must be a floating dtype or None, got torch.int8"
    ):
        HsdpConfig(param_dtype=torch.int8)
    with pytest.raises(MeshConfigError, match="reshard_after_forward must be a bool"):
        HsdpConfig(reshard_after_forward=2)  # type: ignore[arg-type]
    with pytest.raises(MeshConfigError, match="cast_forward_inputs must be a bool, got 'no'"):
        HsdpConfig(cast_forward_inputs="no")  # type: ignore[arg-type]
    with pytest.raises(MeshConfigError, match="forward_prefetch must be a bool, got 1"):
        HsdpConfig(forward_prefetch=1)  # type: ignore[arg-type]
    with pytest.raises(MeshConfigError, match=r"micro_batches must be a positive int, got 0"):
        ParityConfig(replicate=1, shard=1, micro_batches=0)
    with pytest.raises(MeshConfigError, match=r"rtol must be positive, got 0"):
        ParityConfig(replicate=1, shard=1, rtol=0)
    with pytest.raises(MeshConfigError, match=r"num_micro_batches must be at least 1, got 0"):
        accumulate_gradients(torch.nn.Linear(2, 2), 0)
    with pytest.raises(MeshConfigError, match="has no FSDP-sharded modules"):
        accumulate_gradients(torch.nn.Linear(2, 2), 2)
    with pytest.raises(MeshConfigError, match=r"max_norm must be positive, got 0"):
        clip_grad_norm(torch.nn.Linear(2, 2), 0.0)
    with pytest.raises(MeshConfigError, match=r"norm_type must be positive"):
        grad_norm(torch.nn.Linear(2, 2), -1.0)
    assert issubclass(AccumulationError, PosttrainError)


def test_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(MeshConfigError, match=r"non-negative int, got -1"):
        checkpoint_dir(tmp_path, -1)
    assert checkpoint_dir(tmp_path, 42) == tmp_path / "iter_0000042"
    assert latest_step(tmp_path) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("abc\n")
    with pytest.raises(CheckpointError, match="holds 'abc', not a step number"):
        latest_step(tmp_path)
    (tmp_path / "iter_0000001").mkdir()
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        read_meta(tmp_path / "iter_0000001")
    (tmp_path / "iter_0000001" / "meta.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(CheckpointError, match="malformed"):
        read_meta(tmp_path / "iter_0000001")


def test_single_process_clip_matches_torch() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 4), torch.nn.Linear(5, 4)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 5)
    a(x).square().sum().backward()
    b(x).square().sum().backward()
    ours = clip_grad_norm(a, 0.1)
    theirs = float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1))
    assert ours == pytest.approx(theirs, rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
    assert grad_norm(list(a.parameters()), 1.0) > 0


def test_scale_grads_to_norm_scales_only_above_the_limit() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])  # norm 5
    scale_grads_to_norm([param], 5.0, 10.0)  # under the limit: untouched
    assert param.grad.tolist() == [3.0, 4.0]
    scale_grads_to_norm([param], 5.0, 1.0)
    assert float(param.grad.norm()) == pytest.approx(1.0, rel=1e-5)
    before = param.grad.clone()
    scale_grads_to_norm([param], float("nan"), 1.0)  # the caller skips a non-finite step
    assert torch.equal(param.grad, before)
    with pytest.raises(MeshConfigError, match="max_norm"):
        scale_grads_to_norm([param], 5.0, 0.0)
