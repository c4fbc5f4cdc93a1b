"""The fused Triton NVFP4 kernels produce the CPU reference's bytes, for every config.

On a CUDA machine the kernels run on the device; elsewhere Triton's interpreter runs the same
kernel source on CPU tensors, so the arithmetic (div_rn, the E4M3 bit rounding, the sequential
4-over-6 error sums) is checked bit for bit here too. The interpreter must be switched on
before Triton is imported (its own library functions are decorated then), so on CPU one test
runs this file again in a fresh process with ``TRITON_INTERPRET=1`` and the kernel tests run
there (they show as skipped in the parent). Shapes stay small: the interpreter is numpy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from posttrain.quant_convert import QuantInputError
from posttrain.quant_convert.nvfp4 import (
    NVFP4Config,
    NVFP4Tensor,
    quantize_nvfp4,
    quantize_nvfp4_many,
    quantize_nvfp4_pair,
)

GOLDEN = json.loads((Path(__file__).parent / "golden_nvfp4.json").read_text())
CONFIGS = [
    NVFP4Config(),
    NVFP4Config(scale_rounding="te-divide"),
    NVFP4Config(four_over_six="mae"),
    NVFP4Config(four_over_six="mse"),
    NVFP4Config(four_over_six="mae", e4m3_max=448),
    NVFP4Config(four_over_six="mse", scale_rounding="te-divide", e4m3_max=448),
]
RUN_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(
    not RUN_HERE, reason="no CUDA: run under the interpreter by test_kernels_under_interpreter"
)


@pytest.mark.skipif(RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-500:]
    assert "failed" not in r.stdout, r.stdout[-500:]


def test_the_package_never_imports_triton_for_cpu_work() -> None:
    code = (
        "import sys, torch\n"
        "import posttrain.quant_convert.live, posttrain.quant_convert.convert\n"
        "from posttrain.quant_convert.nvfp4 import quantize_nvfp4, quantize_nvfp4_many\n"
        "quantize_nvfp4(torch.randn(4, 32))\n"
        "quantize_nvfp4_many([('w', torch.randn(4, 32))])\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _hard_rows(rows: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian rows plus the cases the kernel must not get wrong: zero and -0.0 blocks,
    heavy-tailed rows, rows whose block scales are E4M3 subnormals or round to zero, exact
    E2M1 midpoints (ties) under a unit block scale."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.02
    w[0, :16] = 0.0
    w[1, 16:32] = -0.0
    w[1, 32:48] = torch.tensor([0.0, -0.0] * 8)
    heavy = torch.randn(k, generator=g) / torch.rand(k, generator=g).clamp_min(1e-3) ** 2
    w[2] = heavy * 0.02
    w[3] *= 1e-5  # scales below 2**-6 (subnormal) and below 2**-10 (zero) against row 2
    w[4] *= 3e-4
    w[5, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 0.02
    return w.to(dtype)


def _same(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    assert torch.equal(a.packed, b.packed.cpu())
    assert torch.equal(a.scale.view(torch.uint8), b.scale.cpu().view(torch.uint8))
    assert a.scale_2.shape == b.scale_2.shape
    assert torch.equal(a.scale_2.view(torch.int32), b.scale_2.cpu().view(torch.int32))


@kernel_test
@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.four_over_six}-{c.scale_rounding}-{c.emax:g}"
)
def test_kernel_bytes_equal_cpu_reference(device: str, cfg: NVFP4Config) -> None:
    for dtype, rows in ((torch.bfloat16, 37), (torch.float32, 6), (torch.float16, 7)):
        w = _hard_rows(rows, 64, seed=rows, dtype=dtype)
        ref = quantize_nvfp4(w, cfg=cfg)
        _same(ref, quantize_nvfp4(w.to(device), cfg=cfg, backend="triton"))


@kernel_test
@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=lambda c: f"{c.four_over_six}-{c.scale_rounding}")
def test_kernel_pair_and_experts_equal_cpu_reference(device: str, cfg: NVFP4Config) -> None:
    gate = _hard_rows(13, 48, seed=1, dtype=torch.bfloat16)
    up = _hard_rows(9, 48, seed=2, dtype=torch.bfloat16) * 4  # up holds the shared amax
    ref = quantize_nvfp4_pair(gate, up, cfg=cfg)
    got = quantize_nvfp4_pair(gate.to(device), up.to(device), cfg=cfg, backend="triton")
    for r, g in zip(ref, got, strict=True):
        _same(r, g)
    assert torch.equal(got[0].scale_2, got[1].scale_2)
    stack = torch.stack(
        [_hard_rows(6, 48, seed=s, dtype=torch.bfloat16) * 10**s for s in (0, 1, 2)]
    )
    ref3 = quantize_nvfp4(stack, cfg=cfg, allow_3d=True)
    _same(ref3, quantize_nvfp4(stack.to(device), cfg=cfg, allow_3d=True, backend="triton"))


def _value(v: Any) -> float:
    return {"MAX": 3.4028234663852886e38, "-MAX": -3.4028234663852886e38}.get(v, v)  # type: ignore[no-any-return]


@kernel_test
@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: c["name"])
def test_kernel_on_golden_vectors(device: str, case: dict[str, Any]) -> None:
    w = torch.tensor([[float(_value(v)) for v in row] for row in case["rows"]])
    cfg = NVFP4Config(**case["config"])
    _same(quantize_nvfp4(w, cfg=cfg), quantize_nvfp4(w.to(device), cfg=cfg, backend="triton"))


@kernel_test
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_kernel_refuses_non_finite_naming_the_tensor(device: str, bad: float) -> None:
    w = torch.zeros(3, 32)
    w[2, 20] = bad
    kind = "NaN" if bad != bad else "Inf"
    with pytest.raises(QuantInputError, match=rf"experts\.3\.up_proj\.weight: contains {kind}"):
        quantize_nvfp4(w.to(device), name="experts.3.up_proj.weight", backend="triton")
    # a given global amax does not hide it: the kernel flags the block itself
    with pytest.raises(QuantInputError, match=kind):
        quantize_nvfp4(w.to(device), global_amax=1.0, backend="triton")


@kernel_test
@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=lambda c: f"{c.four_over_six}-{c.scale_rounding}")
def test_grouped_many_equals_one_by_one(device: str, cfg: NVFP4Config) -> None:
    """The live path's grouped launches (pairs sharing amax slots across launch groups of
    different sizes, 3-D experts, fp16/fp32 beside bf16, a strided view, an empty weight)
    give each weight the bytes of its own CPU quantization."""
    big = _hard_rows(20, 64, seed=13, dtype=torch.float32)
    ws = {
        "e0.gate": _hard_rows(7, 48, seed=3, dtype=torch.bfloat16),
        "e0.up": _hard_rows(7, 48, seed=4, dtype=torch.bfloat16) * 8,
        "e0.down": _hard_rows(6, 48, seed=5, dtype=torch.bfloat16),
        "e1.gate": _hard_rows(7, 48, seed=6, dtype=torch.bfloat16) * 1e-3,
        "e1.up": _hard_rows(7, 48, seed=7, dtype=torch.bfloat16),
        "odd.gate": _hard_rows(6, 48, seed=8, dtype=torch.bfloat16),
        "odd.up": _hard_rows(7, 48, seed=9, dtype=torch.bfloat16),
        "stack.gate": torch.stack(
            [_hard_rows(6, 48, seed=s, dtype=torch.bfloat16) * 10**s for s in (1, 2)]
        ),
        "stack.up": torch.stack([_hard_rows(6, 48, seed=s, dtype=torch.bfloat16) for s in (3, 4)]),
        "half.down": _hard_rows(6, 48, seed=10, dtype=torch.float16),
        "view.down": big[1:9, 16:64],
        "empty.down": torch.zeros(0, 32, dtype=torch.bfloat16),
    }
    partners = {}
    for p in ("e0", "e1", "odd", "stack"):
        partners[f"{p}.gate"], partners[f"{p}.up"] = f"{p}.up", f"{p}.gate"
    from posttrain.quant_convert import _nvfp4_triton as kernels
    from posttrain.quant_convert._grouped import quantize_grouped

    on_device = [(n, w.to(device)) for n, w in ws.items()]
    runs = [quantize_nvfp4_many(on_device, partners=partners, cfg=cfg, backend="triton")]
    tunings = [kernels.KernelTuning(four_over_six_rows=False, blocks_per_program_4over6=16)]
    if cfg.four_over_six == "off":  # the two orders, a stage per unit or per 2000 bytes, and
        # one thread per block (or per 16 blocks)
        tunings = [
            kernels.KernelTuning(pipeline=False),
            kernels.KernelTuning(pipeline=True, pipeline_stage_bytes=1),
            kernels.KernelTuning(pipeline=True, pipeline_stage_bytes=2000),
            kernels.KernelTuning(pipeline=False, block_per_thread=True, blocks_per_program=16),
            kernels.KernelTuning(pipeline=True, block_per_thread=True, pipeline_stage_bytes=1),
        ]
    runs += [quantize_grouped(on_device, partners, cfg, tuning) for tuning in tunings]
    for got in runs:
        assert list(got) == list(ws)
        for p in ("e0", "e1", "odd", "stack"):
            ref_gate, ref_up = quantize_nvfp4_pair(
                ws[f"{p}.gate"], ws[f"{p}.up"], cfg=cfg, allow_3d=True
            )
            _same(ref_gate, got[f"{p}.gate"])
            _same(ref_up, got[f"{p}.up"])
            assert torch.equal(got[f"{p}.gate"].scale_2, got[f"{p}.up"].scale_2)
        for n in ("e0.down", "half.down", "view.down", "empty.down"):
            _same(quantize_nvfp4(ws[n], cfg=cfg), got[n])


@kernel_test
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_grouped_refuses_non_finite_naming_the_tensor(device: str, bad: float) -> None:
    """One bucket, one synchronisation: the pre-pass flags the very tensor (also a 3-D one, or
    the partner of a pair whose other half is fine), and nothing else is blamed."""
    ws = {
        "l.0.gate_proj.weight": _hard_rows(7, 48, seed=3, dtype=torch.bfloat16),
        "l.0.up_proj.weight": _hard_rows(7, 48, seed=4, dtype=torch.bfloat16),
        "l.0.experts.w13": torch.zeros(3, 4, 32, dtype=torch.bfloat16),
        "l.0.down_proj.weight": _hard_rows(6, 48, seed=5, dtype=torch.float32),
    }
    partners = {"l.0.gate_proj.weight": "l.0.up_proj.weight"}
    partners["l.0.up_proj.weight"] = "l.0.gate_proj.weight"
    kind = "NaN" if bad != bad else "Inf"
    for name, at in (
        ("l.0.up_proj.weight", (6, 47)),
        ("l.0.experts.w13", (2, 3, 31)),
        ("l.0.down_proj.weight", (0, 0)),
    ):
        w = {n: t.clone() for n, t in ws.items()}
        w[name][at] = bad
        with pytest.raises(QuantInputError, match=rf"^{re.escape(name)}: contains {kind}"):
            quantize_nvfp4_many(
                [(n, t.to(device)) for n, t in w.items()], partners=partners, backend="triton"
            )


@kernel_test
def test_prepass_amax_equals_torch(device: str) -> None:
    """The fused pre-pass alone: each slot holds torch's max|w| (per expert for 3-D, over both
    halves of a pair), and no flag is set for finite inputs."""
    from posttrain.quant_convert._grouped import plan_bucket, run_prepass

    g = torch.Generator().manual_seed(5)
    gate = torch.randn(3, 8, 32, generator=g) * torch.tensor([1e-3, 1.0, 7.0])[:, None, None]
    up = torch.randn(3, 8, 32, generator=g) * torch.tensor([2.0, 1e-2, 1.0])[:, None, None]
    down = -torch.rand(5, 64, generator=g) * 3  # its amax is a negative value's magnitude
    zero = torch.zeros(4, 16)
    zero[1, 3] = -0.0
    ws = [("g", gate.bfloat16()), ("u", up.bfloat16()), ("d", down.half()), ("z", zero)]
    bucket = plan_bucket([(n, t.to(device)) for n, t in ws], {"g": "u", "u": "g"})
    run_prepass(bucket)
    amax = bucket.bits[: bucket.slots].view(torch.float32).cpu()
    pair = torch.maximum(
        ws[0][1].float().abs().amax(dim=(1, 2)), ws[1][1].float().abs().amax(dim=(1, 2))
    )
    want = torch.cat([pair, ws[2][1].float().abs().amax()[None], torch.zeros(1)])
    assert torch.equal(amax.view(torch.int32), want.view(torch.int32))
    assert not bool(bucket.bits[bucket.slots :].cpu().any())


@kernel_test
@pytest.mark.parametrize(
    "cfg",
    [CONFIGS[1], CONFIGS[2], CONFIGS[5]],
    ids=lambda c: f"{c.four_over_six}-{c.scale_rounding}",
)
def test_every_launch_shape_writes_the_same_bytes(device: str, cfg: NVFP4Config) -> None:
    """The tunings the benchmark sweeps (one-thread-per-block or block-tile 4-over-6, word or
    byte packing, tile sizes) change speed only."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    w = _hard_rows(9, 80, seed=11, dtype=torch.bfloat16)
    ref = quantize_nvfp4(w, cfg=cfg)
    amax = torch.tensor([float(w.float().abs().max())], device=device)
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    for tuning in (
        kernels.KernelTuning(pack_words=True, blocks_per_program=16),
        kernels.KernelTuning(pack_words=False, blocks_per_program=32),
        kernels.KernelTuning(blocks_per_program_4over6=16, num_warps_4over6=1),
        kernels.KernelTuning(four_over_six_rows=False, blocks_per_program_4over6=16),
        kernels.KernelTuning(blocks_per_program_4over6=64, num_warps_4over6=2),
        kernels.KernelTuning(max_registers_4over6=96),
    ):
        packed, scale, ws2, _ = kernels.quantize_matrices(
            w.to(device).unsqueeze(0), amax, slots, four_over_six=cfg.four_over_six,
            scale_rounding=cfg.scale_rounding, emax=cfg.emax, tuning=tuning,
        )  # fmt: skip
        _same(ref, NVFP4Tensor(packed[0], scale[0], ws2[0]))


@kernel_test
@pytest.mark.parametrize(
    "cfg", [CONFIGS[2], CONFIGS[5]], ids=lambda c: f"{c.four_over_six}-{c.emax:g}"
)
def test_4over6_equals_cpu_across_the_amax_range(device: str, cfg: NVFP4Config) -> None:
    """The 4-over-6 kernel dequantizes from two divisions per block while the global amax
    lies in [2**-100, 2**115] and divides per element outside it: both sides of each bound."""
    from posttrain.quant_convert import _nvfp4_triton as kernels

    w = _hard_rows(6, 64, seed=12, dtype=torch.float32)
    w[3] = w[0]  # no fp32-subnormal inputs: only the amax range is under test here
    w[0, 16:32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * 0.02
    top = float(w.abs().max())
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    for amax in (2.0**-101, 2.0**-100, 2.0**-99, 1.0, 2.0**114, 2.0**115, 2.0**116, 2.0**125):
        x = w * (amax / top)
        assert float(x.abs().max()) == amax
        ref = quantize_nvfp4(x, cfg=cfg)
        _same(ref, quantize_nvfp4(x.to(device), cfg=cfg, backend="triton"))
        packed, scale, ws2, _ = kernels.quantize_matrices(
            x.to(device).unsqueeze(0), torch.tensor([amax], device=device), slots,
            four_over_six=cfg.four_over_six, scale_rounding=cfg.scale_rounding, emax=cfg.emax,
            tuning=kernels.KernelTuning(four_over_six_rows=False),
        )  # fmt: skip
        _same(ref, NVFP4Tensor(packed[0], scale[0], ws2[0]))


def test_4over6_dequantized_value_factors_into_a_power_of_two() -> None:
    """The identity the 4-over-6 kernel's per-block values rest on, in IEEE fp32 on the CPU:
    ``((q*s)*A)/D == +-2**j * ((m*s)*A)/D`` for |q| = m * 2**j, every positive E4M3 scale s,
    D = 6*Emax for both Emax, and amaxes sampled in binades from 2**-100 up to 2**115."""
    g = torch.Generator().manual_seed(0)
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert float(scales.min()) == 2.0**-9
    assert float(scales.max()) == 448.0
    mags = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    m = torch.tensor([1.0, 1.0, 1.5, 1.0, 1.5, 1.0, 1.5])
    mant = torch.cat([1 + torch.rand(1 << 8, generator=g), torch.tensor([1.0, 2 - 2**-23])])
    for exp in (-100, -99, -60, -20, -1, 0, 1, 40, 100, 113, 114):
        amax = (mant * 2.0**exp).float()
        assert float(amax.max()) <= 2.0**115
        s, a = scales[:, None, None], amax[None, :, None]
        for denom in (torch.tensor(1536.0), torch.tensor(2688.0)):
            for sign in (1.0, -1.0):
                want = ((sign * mags * s) * a) / denom
                got = (((m * s) * a) / denom) * (sign * mags / m)
                assert torch.equal(want.view(torch.int32), got.view(torch.int32)), (exp, denom)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for the device: not interpreted"
)
def test_grouped_kernels_compile_for_hopper_with_vector_loads() -> None:
    """The grouped kernels compile for sm_90 (no GPU needed: Triton's own LLVM and ptxas) and,
    although each matrix's input is found through the table, still load 16 bytes at a time
    (the offset is a count of 16-element blocks, so the alignment of the launch's base tensor
    carries over): 8 vector loads per quantize tile and per pre-pass tile of 4096 BF16."""
    import triton  # type: ignore[import-untyped]
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    from posttrain.quant_convert import _nvfp4_triton as kernels

    def ptx(fn: Any, sig: dict[str, str], consts: dict[str, Any], aligned: list[str]) -> str:
        names = list(sig)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        target = GPUTarget("cuda", 90, 32)
        return str(triton.compile(src, target=target, options={"num_warps": 2}).asm["ptx"])

    ptrs = {"x_ptr": "*bf16", "meta_ptr": "*i64", "bits_ptr": "*i32"}
    out = {"packed_ptr": "*u8", "scale_ptr": "*u8", "ws2_ptr": "*fp32"}
    ints = ["q_first", "q_rows", "p_first", "p_rows", "blocks_per_matrix", "tiles"]
    consts = {
        "EMAX": 448.0,
        "MODE": 0,
        "BLOCKS": 256,
        "PACK_WORDS": False,
        "ROWS": False,
    }
    sig = {**ptrs, **out, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
    code = ptx(kernels._pipelined_kernel, sig, consts, [*ptrs, *out])
    assert code.count("ld.global.v4.b32") == 16, "8 per pre-pass tile, 8 per quantize tile"
    consts = {"TILE": 4096, "TILES": 1}
    sig = {**ptrs, "first_row": "i32", "per_matrix": "i32", **dict.fromkeys(consts, "constexpr")}
    # per_matrix (N*K, K a multiple of 16) is a multiple of 16: Triton specializes it so
    assert (
        ptx(kernels._prepass_kernel, sig, consts, [*ptrs, "per_matrix"]).count("ld.global.v4.b32")
        == 8
    )
    # the one-read kernel, with its outputs' address read on the device (a recorded replay)
    # or given: the same 16-byte loads and the same stores either way
    stores = []
    for indirect in (False, True):
        ptrs = {"x_ptr": "*bf16", "meta_ptr": "*i64", "bits_ptr": "*i32", "guess_ptr": "*i32"}
        out = {"packed_ptr": "*i64", "scale_ptr": "*u8", "ws2_ptr": "*fp32", "addr_ptr": "*i64"}
        ints = ["code_at", "scale_at", "first_row", "blocks_per_matrix", "tiles"]
        consts = {"EMAX": 448.0, "MODE": 0, "BLOCKS": 256, "INDIRECT": indirect}
        sig = {**ptrs, **out, **dict.fromkeys(ints, "i32"), **dict.fromkeys(consts, "constexpr")}
        code = ptx(kernels._speculative_kernel, sig, consts, [*ptrs, *out, "code_at", "scale_at"])
        assert code.count("ld.global.v4.b32") == 8, indirect  # 256 blocks of BF16, 2 warps
        stores.append(sorted(re.findall(r"\bst\.global[.\w]*", code)))
    assert stores[0] == stores[1]


def test_bucket_layout_is_planned_once_per_bucket() -> None:
    """A weight sync sends the same buckets every step: the second plan of the same tensors
    reuses the table (no host work, no host-to-device copy), fresh output buffers every call;
    another pointer, shape or pairing is planned anew; views that needed a copy are never
    kept; the store is bounded."""
    from posttrain.quant_convert import _grouped

    _grouped._PLANS.clear()
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(4, 32, generator=g).bfloat16() for _ in range(3))
    ws = [("gate", gate), ("up", up), ("down", down)]
    pairs = {"gate": "up", "up": "gate"}
    first = _grouped.plan_bucket(ws, pairs)
    again = _grouped.plan_bucket(ws, pairs)
    assert again.meta is first.meta
    assert len(_grouped._PLANS) == 1
    assert again.packed.data_ptr() != first.packed.data_ptr()  # outputs never shared
    assert _grouped.plan_bucket(ws, {}).meta is not first.meta  # other pairing
    moved = [("gate", gate.clone()), ("up", up), ("down", down)]
    assert _grouped.plan_bucket(moved, pairs).meta is not first.meta  # other pointer
    assert len(_grouped._PLANS) == 3
    wide = torch.randn(4, 64, generator=g).bfloat16()
    view = [("down", wide[:, 16:48])]  # not contiguous: copied, so never kept
    _grouped.plan_bucket(view, {})
    _grouped.plan_bucket(view, {})
    assert len(_grouped._PLANS) == 3
    for i in range(_grouped.PLAN_CACHE_SIZE + 5):
        _grouped.plan_bucket([(f"w{i}", down)], {})
    assert len(_grouped._PLANS) == _grouped.PLAN_CACHE_SIZE
    _grouped._PLANS.clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="calls are kept on the kernels' path")
def test_a_kept_live_call_sees_new_values_and_still_refuses_nan() -> None:
    """The second sync of the same parameters (same pointers) skips every host step, yet
    quantizes the values they hold now, byte for byte as the CPU, and still refuses NaN."""
    from posttrain.quant_convert import QuantPolicy, live, quantize_named_params

    live._CALLS.clear()
    g = torch.Generator().manual_seed(3)
    names = [
        f"model.layers.0.mlp.experts.3.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
    ]
    named = [(n, (torch.randn(32, 64, generator=g) * 0.1).bfloat16().cuda()) for n in names]
    named.append(("model.layers.0.input_layernorm.weight", torch.ones(64).bfloat16().cuda()))
    policy = QuantPolicy(num_layers_at_end_in_bf16=0)

    def same_as_cpu() -> None:
        got = quantize_named_params(named, num_layers=1, policy=policy)
        want = quantize_named_params([(n, t.cpu()) for n, t in named], num_layers=1, policy=policy)
        assert [n for n, _ in got] == [n for n, _ in want]
        for (n, a), (_, b) in zip(got, want, strict=True):
            flat_a, flat_b = a.cpu().reshape(-1), b.reshape(-1)  # weight_scale_2 is 0-d
            assert torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8)), n

    same_as_cpu()
    assert len(live._CALLS) == 1  # the three expert weights: one bucket, kept
    for _, t in named[:3]:
        t.mul_(-3.0)  # in place: the same pointers, so the call is kept
    same_as_cpu()
    assert len(live._CALLS) == 1
    named[1][1][5, 7] = float("nan")
    with pytest.raises(
        QuantInputError, match=r"^model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight: "
    ):
        quantize_named_params(named, num_layers=1, policy=policy)
    live._CALLS.clear()


@kernel_test
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=["te-multiplier", "te-divide"])
def test_a_bucket_seen_before_bets_on_its_amaxes_and_keeps_the_bytes(
    device: str, cfg: NVFP4Config
) -> None:
    """The second run of a kept bucket reads each weight once, betting on the last run's
    amaxes: won bets (unchanged weights), lost bets (a pair's max moved up, a weight's moved
    down, a 3-D expert's one matrix moved) and a NaN all give the CPU's bytes or its refusal."""
    from posttrain.quant_convert import _grouped

    _grouped._PLANS.clear()
    ws = {
        "e0.gate": _hard_rows(12, 64, seed=11, dtype=torch.bfloat16),
        "e0.up": _hard_rows(12, 64, seed=12, dtype=torch.bfloat16),
        "e1.down": _hard_rows(10, 48, seed=13, dtype=torch.bfloat16),
        "x.gate": torch.stack([_hard_rows(6, 48, seed=s, dtype=torch.bfloat16) for s in (14, 15)]),
        "x.up": torch.stack([_hard_rows(6, 48, seed=s, dtype=torch.bfloat16) for s in (16, 17)]),
        "odd.gate": _hard_rows(6, 48, seed=18, dtype=torch.bfloat16),
        "odd.up": _hard_rows(7, 48, seed=19, dtype=torch.bfloat16),  # two launch groups
    }
    partners = {}
    for p in ("e0", "x", "odd"):
        partners[f"{p}.gate"], partners[f"{p}.up"] = f"{p}.up", f"{p}.gate"
    on_device = [(n, w.to(device)) for n, w in ws.items()]
    dev = dict(on_device)

    def run_and_compare() -> None:
        got = _grouped.quantize_grouped(on_device, partners, cfg)
        for p in ("e0", "x", "odd"):
            gate, up = dev[f"{p}.gate"].cpu(), dev[f"{p}.up"].cpu()
            ref_gate, ref_up = quantize_nvfp4_pair(gate, up, cfg=cfg, allow_3d=True)
            _same(ref_gate, got[f"{p}.gate"])
            _same(ref_up, got[f"{p}.up"])
        _same(quantize_nvfp4(dev["e1.down"].cpu(), cfg=cfg), got["e1.down"])

    run_and_compare()  # the first run: two passes, and the amaxes are kept
    (layout,) = _grouped._PLANS.values()
    assert layout.last_amax is not None
    run_and_compare()  # every bet won
    assert layout.speculate
    with torch.no_grad():
        dev["e0.gate"].mul_(2.0)  # the pair's amax moves up
        dev["e0.up"].mul_(2.0)
        dev["e1.down"].mul_(0.5)  # down
        dev["x.gate"][1].mul_(-3.0)  # one expert of a 3-D pair
        dev["x.up"][1].mul_(-3.0)
        odd_max = torch.maximum(dev["odd.gate"].abs().max(), dev["odd.up"].abs().max())
        dev["odd.up"][0, 0] = odd_max * 4  # a pair across two launches
    run_and_compare()  # lost bets, redone
    assert not layout.speculate  # 85% of the bytes moved: the next run takes two passes
    run_and_compare()
    assert layout.speculate  # nothing moved: bet again
    run_and_compare()  # and won
    dev["e1.down"][3, 5] = float("nan")
    with pytest.raises(QuantInputError, match=r"^e1\.down: contains NaN"):
        _grouped.quantize_grouped(on_device, partners, cfg)
    assert layout.speculate  # one weight of 13% of the bytes moved: still worth a bet
    dev["e1.down"][3, 5] = 0.0
    run_and_compare()  # the NaN's bits were the bet: lost, redone
    _grouped._PLANS.clear()


@kernel_test
def test_a_recorded_run_replays_into_fresh_buffers_and_steps_aside_while_busy(
    device: str,
) -> None:
    """A kept bucket's betting run is recorded once (a CUDA graph on CUDA) and replayed: each
    replay writes a buffer of its own (earlier outputs stay as they were), a start while a
    replay is unchecked runs eagerly beside it, a moved amax is redone, a NaN is still
    refused, and a different config records afresh: the CPU's bytes every time."""
    from posttrain.quant_convert import _grouped

    _grouped._PLANS.clear()
    gate = _hard_rows(12, 64, seed=21, dtype=torch.bfloat16).to(device)
    up = _hard_rows(12, 64, seed=22, dtype=torch.bfloat16).to(device)
    down = _hard_rows(8, 48, seed=23, dtype=torch.bfloat16).to(device)
    weights = [("gate", gate), ("up", up), ("down", down)]
    partners = {"gate": "up", "up": "gate"}

    def reference(cfg: NVFP4Config) -> dict[str, NVFP4Tensor]:
        g, u = quantize_nvfp4_pair(gate.cpu(), up.cpu(), cfg=cfg)
        return {"gate": g, "up": u, "down": quantize_nvfp4(down.cpu(), cfg=cfg)}

    def snapshot(got: dict[str, NVFP4Tensor]) -> dict[str, NVFP4Tensor]:
        return {
            n: NVFP4Tensor(q.packed.cpu().clone(), q.scale.cpu().clone(), q.scale_2.cpu().clone())
            for n, q in got.items()
        }

    def same_as(want: dict[str, NVFP4Tensor], got: dict[str, NVFP4Tensor]) -> None:
        for n in want:
            _same(want[n], got[n])

    cfg = NVFP4Config()
    _grouped.quantize_grouped(weights, partners, cfg)  # two passes; the amaxes are kept
    (layout,) = _grouped._PLANS.values()
    assert layout.replay is None
    first = _grouped.quantize_grouped(weights, partners, cfg)  # the bet, recorded
    assert layout.replay is not None
    recorded = layout.replay
    kept = snapshot(first)
    same_as(reference(cfg), first)
    with torch.no_grad():
        up.mul_(-2.0)  # the pair's amax moves: a lost bet, redone inside the replay
    out_a, check_a = _grouped.start_grouped(weights, partners, cfg)
    assert recorded.busy
    out_b, check_b = _grouped.start_grouped(weights, partners, cfg)  # eager, beside it
    check_a()
    check_b()
    assert not recorded.busy
    assert layout.replay is recorded
    want = reference(cfg)
    same_as(want, out_a)
    same_as(want, out_b)
    assert out_a["gate"].packed.data_ptr() != out_b["gate"].packed.data_ptr()
    same_as(kept, first)  # the first replay's buffer was not written again
    same_as(want, _grouped.quantize_grouped(weights, partners, cfg))  # a won bet, replayed
    other = NVFP4Config(scale_rounding="te-divide")
    _grouped.quantize_grouped(weights, partners, other)
    assert layout.replay is not recorded  # recorded again under the other config
    same_as(reference(other), _grouped.quantize_grouped(weights, partners, other))
    down[2, 3] = float("inf")
    with pytest.raises(QuantInputError, match=r"^down: contains (NaN|Inf)"):
        _grouped.quantize_grouped(weights, partners, other)
    assert not layout.replay.busy
    _grouped._PLANS.clear()
