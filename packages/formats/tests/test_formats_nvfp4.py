"""NVFP4 tensors: packing round trips, and dequantization against a reference built from the
E2M1 and E4M3 bit definitions (independent of quant-convert and of ``E2M1_VALUES``)."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import (
    E2M1_VALUES,
    GROUP_SIZE,
    NVFP4FormatError,
    dequantize_nvfp4,
    dequantize_nvfp4_state_dict,
    e2m1_code_values,
    nvfp4_layout,
    pack_e2m1_codes,
    unpack_e2m1_codes,
)


def _e2m1_value(code: int) -> float:
    """E2M1 from its bits: 1 sign, 2 exponent (bias 1), 1 mantissa; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def _e4m3_value(byte: int) -> float:
    """float8_e4m3fn from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    mag = man / 8 * 2.0**-6 if exp == 0 else 2.0 ** (exp - 7) * (1 + man / 8)
    return sign * mag


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def _reference(
    codes: list[list[int]], scale_bytes: list[list[int]], s2: float
) -> list[list[float]]:
    """fp32 ``value * fp32(scale * s2)``: both products exact in a double, rounded once."""
    return [
        [
            _f32(_e2m1_value(c) * _f32(_e4m3_value(sb[j // GROUP_SIZE]) * s2))
            for j, c in enumerate(row)
        ]
        for row, sb in zip(codes, scale_bytes, strict=True)
    ]


# E4M3 bit patterns of finite non-negative scales (0x7F is NaN; the sign bit is never set).
_SCALE_BYTES = st.integers(0, 0x7E)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=2, max_size=96).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_codes_round_trip(codes: list[int]) -> None:
    c = torch.tensor(codes, dtype=torch.uint8).reshape(1, -1)
    packed = pack_e2m1_codes(c)
    assert packed.shape == (1, len(codes) // 2)
    assert torch.equal(unpack_e2m1_codes(packed), c)
    assert torch.equal(pack_e2m1_codes(unpack_e2m1_codes(packed)), packed)
    assert packed[0, 0].item() == codes[0] | (codes[1] << 4)  # the even element: low nibble


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=64))
def test_any_byte_unpacks_to_codes_that_pack_back(raw: bytes) -> None:
    packed = torch.tensor(list(raw), dtype=torch.uint8).reshape(1, -1)
    codes = unpack_e2m1_codes(packed)
    assert int(codes.max()) <= 15
    assert torch.equal(pack_e2m1_codes(codes), packed)


def test_code_values_follow_the_bit_definition() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    want = [_e2m1_value(c) for c in range(16)]
    assert e2m1_code_values(codes).tolist() == want
    assert list(E2M1_VALUES) == want
    assert e2m1_code_values(codes).dtype == torch.float32
    assert str(e2m1_code_values(torch.tensor([8], dtype=torch.uint8)).item()) == "-0.0"


# fp32 bit patterns of the global scale: every positive normal float in [2**-40, 2**40)
_S2_BITS = st.integers(0x2B800000, 0x537FFFFF)


@settings(max_examples=60, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 3)), s2_bits=_S2_BITS, data=st.data())
def test_dequantize_matches_the_bit_level_reference(
    shape: tuple[int, int], s2_bits: int, data: st.DataObject
) -> None:
    rows, blocks = shape
    k = blocks * GROUP_SIZE
    codes = data.draw(
        st.lists(st.lists(st.integers(0, 15), min_size=k, max_size=k), min_size=rows, max_size=rows)
    )
    sbytes = data.draw(
        st.lists(
            st.lists(_SCALE_BYTES, min_size=blocks, max_size=blocks), min_size=rows, max_size=rows
        )
    )
    s2 = float(struct.unpack("<f", s2_bits.to_bytes(4, "little"))[0])
    packed = pack_e2m1_codes(torch.tensor(codes, dtype=torch.uint8))
    scale = torch.tensor(sbytes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = dequantize_nvfp4(packed, scale, torch.tensor(s2))
    assert got.dtype == torch.float32
    want = torch.tensor(_reference(codes, sbytes, s2), dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, signs of 0 too
    bf16 = dequantize_nvfp4(packed, scale, torch.tensor(s2), dtype=torch.bfloat16)
    assert torch.equal(bf16, want.to(torch.bfloat16))


def test_byte_layout_golden() -> None:
    # byte = code(x0) | code(x1) << 4: 0x71 -> [0.5 (code 1), 6.0 (code 7)]
    out = dequantize_nvfp4(
        torch.tensor([[0x71] * 8], dtype=torch.uint8),
        torch.ones(1, 1).to(torch.float8_e4m3fn),
        torch.tensor(1.0),
    )
    assert out[0, :2].tolist() == [0.5, 6.0]


def test_stacked_experts_take_one_global_scale_each() -> None:
    packed = torch.full((2, 4, 8), 0x22, dtype=torch.uint8)  # every code 2 -> 1.0
    scales = torch.ones(2, 4, 1).to(torch.float8_e4m3fn)
    got = dequantize_nvfp4(packed, scales, torch.tensor([2.0, 3.0]))
    assert got.shape == (2, 4, 16)
    assert got[0].unique().tolist() == [2.0]
    assert got[1].unique().tolist() == [3.0]
    scalar = dequantize_nvfp4(packed, scales, torch.tensor([5.0]))  # one value for every expert
    assert scalar.unique().tolist() == [5.0]


_GOOD = (
    torch.zeros(2, 8, dtype=torch.uint8),
    torch.ones(2, 1).to(torch.float8_e4m3fn),
    torch.tensor(1.0),
)


@pytest.mark.parametrize(
    ("index", "bad", "match"),
    [
        (0, torch.zeros(2, 8, dtype=torch.int8), r"layer\.weight: NVFP4 codes must be uint8"),
        (0, torch.zeros(2, 7, dtype=torch.uint8), r"layer\.weight: shape \[2, 7\]"),
        (1, torch.ones(2, 1), r"layer\.weight_scale: must be float8_e4m3fn"),
        (1, torch.ones(2, 2).to(torch.float8_e4m3fn), r"layer\.weight_scale: shape \[2, 2\]"),
        (1, torch.tensor([[0x7F], [0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn), "NaN"),
        (1, torch.tensor([[-1.0], [1.0]]).to(torch.float8_e4m3fn), "negative"),
        (2, torch.tensor([1.0, 2.0]), r"layer\.weight_scale_2: shape \[2\]"),
        (2, torch.tensor(float("inf")), r"layer\.weight_scale_2: not a finite"),
        (2, torch.tensor(-1.0), r"layer\.weight_scale_2: not a finite non-negative"),
    ],
)
def test_malformed_groups_are_refused_by_name(index: int, bad: torch.Tensor, match: str) -> None:
    args = list(_GOOD)
    args[index] = bad
    with pytest.raises(NVFP4FormatError, match=match):
        dequantize_nvfp4(*args, name="layer")


def test_layout_names_dtypes_and_shapes() -> None:
    specs = nvfp4_layout("m.experts.w1.weight", (4, 6, 32), input_scale=True)
    got = [(s.name, s.part, s.dtype, s.safetensors_dtype, s.shape) for s in specs]
    assert got == [
        ("m.experts.w1.weight", "weight", torch.uint8, "U8", (4, 6, 16)),
        ("m.experts.w1.weight_scale", "weight_scale", torch.float8_e4m3fn, "F8_E4M3", (4, 6, 2)),
        ("m.experts.w1.weight_scale_2", "weight_scale_2", torch.float32, "F32", (4,)),
        ("m.experts.w1.input_scale", "input_scale", torch.float32, "F32", (4,)),
    ]
    assert [s.shape for s in nvfp4_layout("p.weight", (3, 16))] == [(3, 8), (3, 1), ()]
    for name, shape in (("p.bias", (2, 16)), ("p.weight", (2, 24)), ("p.weight", (16,))):
        with pytest.raises(NVFP4FormatError, match=name.replace(".", r"\.")):
            nvfp4_layout(name, shape)


def test_state_dict_dequantizes_groups_and_drops_scales() -> None:
    packed = torch.full((4, 8), 0x22, dtype=torch.uint8)
    state = {
        "x.weight": packed,
        "x.weight_scale": torch.ones(4, 1).to(torch.float8_e4m3fn),
        "x.weight_scale_2": torch.tensor(2.0),
        "x.input_scale": torch.tensor(1.0),
        "attn.k_scale": torch.tensor(1.0),
        "norm.weight": torch.ones(4),
    }
    out, done = dequantize_nvfp4_state_dict(state, dtypes={"x.weight": torch.float16})
    assert set(out) == {"x.weight", "norm.weight"}
    assert done == ("x.weight",)
    assert out["x.weight"].dtype == torch.float16
    assert out["x.weight"].unique().tolist() == [2.0]
    assert out["norm.weight"] is state["norm.weight"]
    default, _ = dequantize_nvfp4_state_dict(state)
    assert default["x.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("drop", "match"),
    [
        ("x.weight_scale_2", r"x\.weight_scale_2: missing for NVFP4 codes x\.weight"),
        ("x.weight", r"x\.weight_scale: scale without codes x\.weight"),
        ("x.weight_scale", r"x\.weight: uint8 weight without x\.weight_scale"),
    ],
)
def test_state_dict_refuses_incomplete_groups(drop: str, match: str) -> None:
    state = {
        "x.weight": torch.zeros(4, 8, dtype=torch.uint8),
        "x.weight_scale": torch.ones(4, 1).to(torch.float8_e4m3fn),
        "x.weight_scale_2": torch.tensor(2.0),
    }
    del state[drop]
    with pytest.raises(NVFP4FormatError, match=match):
        dequantize_nvfp4_state_dict(state)
