"""Conformance with an independent reference: torchao's NVFP4 quantizer (pinned 0.18.0, CPU).

Fed the same global scale, torchao divides where TE multiplies, so on normal-scale blocks the
block scales must be identical and any code that differs must sit at an E2M1 rounding midpoint
(within a few fp32 ulps) and move to the neighbouring grid value. A block scale may differ only
where the exact scale lies on an e4m3 rounding midpoint (bf16 inputs hit those exactly, e.g.
v/A = 3/32): then the two fp32 pre-rounding values straddle the midpoint, the scales are
neighbouring e4m3 values, and the block's codes are not compared. Blocks whose scale is below
the smallest normal e4m3 are left out: torchao clamps scales to 2^-6 there by design.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import unpack_e2m1_codes
from posttrain.quant_convert.nvfp4 import quantize_nvfp4

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.integers(-10, 10),
    heavy=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_torchao_agrees_up_to_midpoint_ties(
    seed: int, log_scale: int, heavy: bool, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 256, generator=g) * 2.0**log_scale
    if heavy:
        w = w * torch.exp(torch.randn(64, 256, generator=g))
    w = w.to(dtype).contiguous()
    ours = quantize_nvfp4(w)
    ao_scale, ao_packed = nvfp4_tensor.nvfp4_quantize(
        w, block_size=16, per_tensor_scale=ours.scale_2
    )

    s_ours = ours.scale.to(torch.float32)
    s_ao = ao_scale.to(torch.float32)
    normal = s_ours >= 2.0**-6
    split = normal & (s_ours != s_ao)
    if bool(split.any()):
        v = w.to(torch.float32).reshape(64, -1, 16).abs().amax(-1)[split]
        s_enc = torch.tensor(2688.0) / w.to(torch.float32).abs().amax()
        d_mult = v * (s_enc * torch.tensor(1.0 / 6.0))
        d_div = (v / 6.0) / ours.scale_2
        mid = (s_ours[split] + s_ao[split]) / 2
        assert bool((torch.minimum(d_mult, d_div) <= mid).all())
        assert bool((torch.maximum(d_mult, d_div) >= mid).all())
        bits = ours.scale.view(torch.uint8)[split].long() - ao_scale.view(torch.uint8)[split].long()
        assert bool(bits.abs().eq(1).all())
    normal = normal & ~split

    c_ours = unpack_e2m1_codes(ours.packed).reshape(64, -1, 16)
    c_ao = unpack_e2m1_codes(ao_packed.view(torch.uint8)).reshape(64, -1, 16)
    differ = (c_ours != c_ao) & normal.unsqueeze(-1)
    if not bool(differ.any()):
        return
    e = torch.clamp(1.0 / (s_ours * ours.scale_2), max=torch.finfo(torch.float32).max)
    y = (w.to(torch.float32).reshape(64, -1, 16) * e.unsqueeze(-1)).abs()[differ]
    nearest = (y.unsqueeze(-1) - MIDPOINTS).abs().min(dim=-1)
    assert bool((nearest.values <= 4 * torch.finfo(torch.float32).eps * y).all())
    a, b = c_ours[differ].long(), c_ao[differ].long()
    assert bool(((a & 8) == (b & 8)).all())  # same sign
    assert bool(((a & 7) - (b & 7)).abs().eq(1).all())  # neighbouring grid value
