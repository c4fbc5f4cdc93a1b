"""The two MoE adapter conventions: exact round trip, PEFT's flattening layout, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.formats import (
    PeftConfigError,
    PeftTensorError,
    peft_key,
    read_peft_adapter,
    stack_expert_adapter,
    unstack_expert_adapter,
    write_peft_adapter,
)
from posttrain.interface import LoraSpec

R, H, I_MOE, I_DENSE, E = 2, 6, 4, 5, 3
C = "model.layers.1.mlp.experts"
SPEC = LoraSpec(r=R, alpha=4.0, target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"))


def _modules() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def pair(fin: int, fout: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(R, fin, generator=g), torch.randn(fout, R, generator=g)

    mods = {
        "model.layers.0.self_attn.q_proj": pair(H, H),
        "model.layers.0.mlp.gate_proj": pair(H, I_DENSE),
        "model.layers.0.mlp.up_proj": pair(H, I_DENSE),
        "model.layers.0.mlp.down_proj": pair(I_DENSE, H),
    }
    for e in range(E):
        mods[f"{C}.{e}.gate_proj"] = pair(H, I_MOE)
        mods[f"{C}.{e}.up_proj"] = pair(H, I_MOE)
        mods[f"{C}.{e}.down_proj"] = pair(I_MOE, H)
    return mods


def _tensors(mods: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {peft_key(m, f): t for m, (a, b) in mods.items() for f, t in (("A", a), ("B", b))}


CONFIG = {"peft_type": "LORA", "r": R, "lora_alpha": 4.0, "target_modules": ["x"]}


def test_stack_layout_is_peft_param_wrapper_layout() -> None:
    mods = _modules()
    cfg, stacked = stack_expert_adapter(CONFIG, mods)
    assert cfg["target_modules"] == ["q_proj"]
    assert cfg["target_parameters"] == [
        "down_proj.weight",
        "experts.down_proj",
        "experts.gate_up_proj",
        "gate_proj.weight",
        "up_proj.weight",
    ]
    assert cfg["rank_pattern"] == {r".*\.gate_up_proj": 2 * R}
    assert cfg["alpha_pattern"] == {r".*\.gate_up_proj": 8.0}
    a, b = stacked[f"{C}.base_layer"]  # gate_up: the inner wrapper
    assert a.shape == (E * 2 * R, H)
    assert b.shape == (2 * I_MOE, 2 * R * E)
    # expert e, rank k: row e*2r+k of A, column k*E+e of B (as PEFT's ParamWrapper reads them)
    e, k = 2, R + 1  # an up-rank of expert 2
    assert torch.equal(a[e * 2 * R + k], mods[f"{C}.{e}.up_proj"][0][k - R])
    assert torch.equal(b[I_MOE:, k * E + e], mods[f"{C}.{e}.up_proj"][1][:, k - R])
    assert not b[:I_MOE, k * E + e].any()  # block-diagonal
    a, b = stacked[C]  # down: the outer wrapper
    assert torch.equal(a[1 * R + 0], mods[f"{C}.1.down_proj"][0][0])
    assert torch.equal(b[:, 1 * E + 2], mods[f"{C}.2.down_proj"][1][:, 1])


def test_write_read_round_trip_is_exact(tmp_path: Path) -> None:
    mods = _modules()
    write_peft_adapter(tmp_path / "a", _tensors(mods), SPEC, moe_convention="target_parameters")
    back = read_peft_adapter(tmp_path / "a")
    assert back.convention == "target_parameters"
    assert set(back.modules) == set(mods)
    for m, (a, b) in mods.items():
        assert torch.equal(back.modules[m][0], a), m
        assert torch.equal(back.modules[m][1], b), m
    assert back.spec.r == R
    assert back.spec.alpha == 4.0


def test_fused_rank_r_gate_up_shares_a_and_keeps_scale() -> None:
    """A gate_up PEFT trained itself (rank r, alpha given by alpha_pattern) unstacks with one A."""
    a = torch.randn(E * R, H)
    b = torch.randn(2 * I_MOE, R * E)
    cfg = dict(
        CONFIG, target_parameters=["experts.gate_up_proj"], alpha_pattern={"gate_up_proj": 8.0}
    )
    out_cfg, mods = unstack_expert_adapter(cfg, {C: (a, b)})
    assert out_cfg["target_modules"] == ["gate_proj", "up_proj", "x"]
    g, u = mods[f"{C}.1.gate_proj"], mods[f"{C}.1.up_proj"]
    assert torch.equal(g[0], u[0])
    assert torch.equal(g[0], a[R : 2 * R])
    # scale 8/r folded into B against the adapter's 4/r
    assert torch.allclose(g[1], 2 * b[:I_MOE].reshape(I_MOE, R, E)[:, :, 1])


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("gate_only", PeftConfigError, "not its pair"),
        ("missing_expert", PeftTensorError, "every expert"),
    ],
)
def test_stack_refuses(case: str, error: type[Exception], match: str) -> None:
    mods = _modules()
    if case == "gate_only":
        mods = {m: p for m, p in mods.items() if not m.endswith("up_proj") or "experts" not in m}
    else:
        del mods[f"{C}.1.down_proj"]
    with pytest.raises(error, match=match):
        stack_expert_adapter(CONFIG, mods)


def test_unstack_refuses_non_block_diagonal_and_bad_fields() -> None:
    _, stacked = stack_expert_adapter(CONFIG, _modules())
    a, b = stacked[f"{C}.base_layer"]
    b = b.clone()
    b[0, -1] = 1.0  # couples gate rows with an up rank
    cfg = dict(
        CONFIG,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        rank_pattern={r".*\.gate_up_proj": 2 * R},
        alpha_pattern={r".*\.gate_up_proj": 8.0},
    )
    with pytest.raises(PeftTensorError, match="not block-diagonal"):
        unstack_expert_adapter(cfg, {f"{C}.base_layer": (a, b), C: stacked[C]})
    with pytest.raises(PeftConfigError, match="neither a stacked"):
        unstack_expert_adapter(dict(cfg, target_parameters=["lm_head.bias"]), {})
    with pytest.raises(PeftConfigError, match="does not select"):
        unstack_expert_adapter(dict(cfg, rank_pattern={"q_proj": 4}), {})


def test_moe_convention_is_checked(tmp_path: Path) -> None:
    with pytest.raises(PeftConfigError, match="moe_convention"):
        write_peft_adapter(tmp_path / "a", _tensors(_modules()), SPEC, moe_convention="stacked")  # type: ignore[arg-type]
