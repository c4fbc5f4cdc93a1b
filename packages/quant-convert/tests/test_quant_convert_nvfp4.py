"""NVFP4 quantizer: hand-derived goldens, an independent numpy reference, and properties."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import E2M1_VALUES, dequantize_nvfp4, nvfp4_layout, unpack_e2m1_codes
from posttrain.quant_convert import QuantInputError
from posttrain.quant_convert.nvfp4 import NVFP4Config, quantize_nvfp4, quantize_nvfp4_pair

GOLDEN = json.loads((Path(__file__).parent / "golden_nvfp4.json").read_text())
FMAX = float(np.finfo(np.float32).max)


def _value(v: Any) -> float:
    if v == "MAX":
        return FMAX
    if v == "-MAX":
        return -FMAX
    return float(v)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_golden_vectors(case: dict[str, Any]) -> None:
    w = torch.tensor([[_value(v) for v in row] for row in case["rows"]], dtype=torch.float32)
    q = quantize_nvfp4(w, cfg=NVFP4Config(**case["config"]))
    if case["scale_2"] == "computed":
        s_enc = np.float32(2688.0) / np.float32(FMAX)
        expected_s2 = float(np.float32(1.0) / s_enc)
    else:
        expected_s2 = float.fromhex(case["scale_2"])
    assert q.scale_2.item() == expected_s2
    assert q.scale.to(torch.float32).tolist() == case["scales"]
    # bytes, not values: a float compare cannot tell a 0x80 (-0.0) scale from 0x00
    expected_bytes = case.get("scale_bytes") or (
        torch.tensor(case["scales"]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    )
    assert q.scale.view(torch.uint8).tolist() == expected_bytes
    assert not torch.signbit(q.scale_2).any()
    assert unpack_e2m1_codes(q.packed).tolist() == case["codes"]


def test_zero_scale_block_decodes_to_zero() -> None:
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0
    w[0, 16] = 2.0**-12
    w[0, 17] = -(2.0**-13)
    q = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q.packed, q.scale, q.scale_2)
    assert deq[0, 16:].abs().max().item() == 0.0
    assert deq[0, 0].item() == 2688.0


# ---- an independent reference: numpy float32, midpoint-table rounding, hand-rolled e4m3 ----


def _np_e4m3(d: np.ndarray) -> np.ndarray:
    d = np.minimum(np.minimum(d, np.float32(FMAX)), np.float32(448.0)).astype(np.float64)
    out = np.zeros_like(d)
    sub = d < 2.0**-6
    out[sub] = np.round(d[sub] / 2.0**-9) * 2.0**-9
    _, exp = np.frexp(d[~sub])  # d = m * 2**exp, m in [0.5, 1)
    spacing = np.ldexp(1.0, exp - 4)  # 3 mantissa bits
    out[~sub] = np.minimum(np.round(d[~sub] / spacing) * spacing, 448.0)
    return out.astype(np.float32)


_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def _np_round_e2m1(y: np.ndarray) -> np.ndarray:
    a = np.abs(y)
    idx = np.searchsorted(_MIDPOINTS, a, side="left").astype(np.int64)  # a > midpoint -> up
    at_tie = np.isin(a, _MIDPOINTS)
    lower = np.searchsorted(_MIDPOINTS, a, side="left")
    # at a tie, searchsorted(left) gives the lower index; keep it if even, else go up
    idx = np.where(at_tie, np.where(lower % 2 == 0, lower, lower + 1), idx)
    return (idx | np.where(y < 0, 8, 0)).astype(np.uint8)


def _np_quantize(w: np.ndarray, rounding: str) -> tuple[np.ndarray, np.ndarray, np.float32]:
    f32 = np.float32
    amax = f32(np.abs(w).max())
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = f32(f32(2688.0) / amax)
    s_enc = f32(min(s_enc, f32(FMAX)))
    s_enc = f32(1.0) if s_enc == 0 else s_enc
    ws2 = f32(f32(1.0) / s_enc)
    blocks = w.reshape(w.shape[0], -1, 16)
    v = np.abs(blocks).max(axis=-1)
    if rounding == "te-multiplier":
        d = (v * f32(s_enc * f32(1.0 / 6.0))).astype(np.float32)
    else:
        d = ((v / f32(6.0)).astype(np.float32) * s_enc).astype(np.float32)
    s = _np_e4m3(d)
    with np.errstate(divide="ignore", over="ignore"):
        e = np.minimum((f32(1.0) / (s * ws2).astype(np.float32)).astype(np.float32), f32(FMAX))
        y = np.clip((blocks * e[..., None]).astype(np.float32), -6.0, 6.0)
    return _np_round_e2m1(y).reshape(w.shape), s, ws2


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 5),
    blocks=st.integers(1, 4),
    log_scale=st.integers(-30, 30),
    rounding=st.sampled_from(["te-multiplier", "te-divide"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_matches_independent_numpy_reference(
    seed: int, rows: int, blocks: int, log_scale: int, rounding: str, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, blocks * 16, generator=g) * 2.0**log_scale).to(dtype)
    # sprinkle exact grid midpoints (relative to a unit scale) to exercise the ties
    w[0, :7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype) * 2.0**log_scale
    q = quantize_nvfp4(w, cfg=NVFP4Config(scale_rounding=rounding))  # type: ignore[arg-type]
    codes, s, ws2 = _np_quantize(w.to(torch.float32).numpy(), rounding)
    assert q.scale_2.item() == float(ws2)
    np.testing.assert_array_equal(q.scale.to(torch.float32).numpy(), s)
    np.testing.assert_array_equal(unpack_e2m1_codes(q.packed).numpy(), codes)


# ---- properties ----

_E4M3_POSITIVE = sorted(
    {
        float(x)
        for x in torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
        if x >= 2.0**-6
    }
)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 3),
    nblocks=st.integers(1, 3),
    k=st.integers(-20, 20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_grid_values_round_trip_exactly(
    data: st.DataObject, rows: int, nblocks: int, k: int, dtype: torch.dtype
) -> None:
    grid = list(E2M1_VALUES)
    vals = torch.tensor(
        data.draw(
            st.lists(
                st.sampled_from(grid), min_size=rows * nblocks * 16, max_size=rows * nblocks * 16
            )
        )
    ).reshape(rows, nblocks, 16)
    vals[:, :, 0] = torch.tensor(
        data.draw(
            st.lists(st.sampled_from([6.0, -6.0]), min_size=rows * nblocks, max_size=rows * nblocks)
        )
    ).reshape(rows, nblocks)
    scales = torch.tensor(
        data.draw(
            st.lists(
                st.sampled_from(_E4M3_POSITIVE), min_size=rows * nblocks, max_size=rows * nblocks
            )
        )
    ).reshape(rows, nblocks)
    scales[0, 0] = 448.0
    x = (vals * scales.unsqueeze(-1) * 2.0**k).reshape(rows, nblocks * 16).to(dtype)
    q = quantize_nvfp4(x)
    back = dequantize_nvfp4(q.packed, q.scale, q.scale_2)
    assert torch.equal(back, x.to(torch.float32))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.integers(-8, 8), heavy=st.booleans())
def test_error_bounds(seed: int, log_scale: int, heavy: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 64, generator=g) * 2.0**log_scale
    if heavy:
        w = w * torch.exp(torch.randn(4, 64, generator=g) * 2)
    q = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q.packed, q.scale, q.scale_2)
    blocks_w = w.reshape(4, -1, 16)
    blocks_d = deq.reshape(4, -1, 16)
    v = blocks_w.abs().amax(-1, keepdim=True)
    err = (blocks_d - blocks_w).abs()
    # any block: error at most the block amax, and no sign flips
    assert bool((err <= v).all())
    assert bool(((blocks_d * blocks_w) >= 0).all())
    # normal-scale blocks: within one decode step S, or the saturation excess over 6S
    s = (q.scale.to(torch.float32) * q.scale_2).unsqueeze(-1)
    normal = (q.scale.to(torch.float32) >= 2.0**-6).unsqueeze(-1).expand_as(err)
    bound = torch.maximum(s, blocks_w.abs() - 6 * s) * (1 + 1e-6)
    assert bool((err <= bound)[normal].all())
    assert bool((err <= 1.0625 * v / 6 * (1 + 1e-6))[normal].all())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n_gate=st.integers(1, 6),
    n_up=st.integers(1, 6),
    mode=st.sampled_from(["off", "mae", "mse"]),
)
def test_pair_equals_concatenation(seed: int, n_gate: int, n_up: int, mode: str) -> None:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(n_gate, 32, generator=g).to(torch.bfloat16)
    up = (torch.randn(n_up, 32, generator=g) * 3).to(torch.bfloat16)
    cfg = NVFP4Config(four_over_six=mode)  # type: ignore[arg-type]
    qg, qu = quantize_nvfp4_pair(gate, up, cfg=cfg)
    qc = quantize_nvfp4(torch.cat([gate, up]), cfg=cfg)
    assert torch.equal(qg.scale_2, qc.scale_2)
    assert torch.equal(qu.scale_2, qc.scale_2)
    assert torch.equal(torch.cat([qg.packed, qu.packed]), qc.packed)
    assert torch.equal(
        torch.cat([qg.scale, qu.scale]).view(torch.uint8), qc.scale.view(torch.uint8)
    )


def test_named_outputs_follow_the_formats_layout() -> None:
    w = torch.randn(2, 3, 32)
    q = quantize_nvfp4(w, allow_3d=True)
    named = q.named("m.experts.w1.weight", input_scale=1.0)
    layout = nvfp4_layout("m.experts.w1.weight", w.shape, input_scale=True)
    assert [n for n, _ in named] == [t.name for t in layout]
    assert [(t.dtype, tuple(t.shape)) for _, t in named] == [(s.dtype, s.shape) for s in layout]
    assert named[3][1].tolist() == [1.0, 1.0]


def test_three_d_experts_quantize_per_expert() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, 32, generator=g)
    w[1] *= 100
    q = quantize_nvfp4(w, allow_3d=True)
    assert q.scale_2.shape == (3,)
    for e in range(3):
        qe = quantize_nvfp4(w[e])
        assert torch.equal(q.packed[e], qe.packed)
        assert q.scale_2[e] == qe.scale_2
    deq = dequantize_nvfp4(q.packed, q.scale, q.scale_2)
    assert deq.shape == w.shape


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (torch.tensor([[float("nan")] * 16]), "NaN"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "Inf"),
        (torch.zeros(2, 24), "multiple of 16"),
        (torch.zeros(2, 16, dtype=torch.int32), "dtype"),
        (torch.zeros(2, 2, 16), "rank"),
    ],
)
def test_bad_inputs_raise_naming_the_tensor(tensor: torch.Tensor, match: str) -> None:
    with pytest.raises(QuantInputError, match=match) as info:
        quantize_nvfp4(tensor, name="model.layers.3.mlp.experts.7.down_proj.weight")
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in str(info.value)
