"""The CUDA strict kernels (``CudaStrictOps``, Triton): accuracy, row invariance, train == decode.

On a CUDA machine the kernels run on the device. Elsewhere Triton's interpreter runs the same
kernel source on CPU tensors: one test reruns this file in a fresh process with
``TRITON_INTERPRET=1`` (it must be set before Triton is imported), where the kernel tests run
(they show as skipped in the parent). The interpreter's ``tl.dot`` is a numpy matmul whose
bits depend on a row's place in the tile (OpenBLAS blocking), unlike the GPU's fp32 ``ieee``
dot, which accumulates each output element over ``k`` in one fixed order; so under the
interpreter this file swaps in a dot with that per-element order (``_sequential_dot``). What
the interpreter checks is the kernels' own logic (tiles, masks, block loops, the choice of
which rows share a tile); the GPU run checks the instructions themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from posttrain.models import (
    DecoderModel,
    LoraAdapter,
    ModelConfig,
    build_model,
    decoded_logprobs,
    packed_logprobs,
)

ON_CUDA = torch.cuda.is_available()
RUN_HERE = ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
kernel_test = pytest.mark.skipif(
    not RUN_HERE, reason="no CUDA: run under the interpreter by test_kernels_under_interpreter"
)


def _sequential_dot() -> None:
    """Make the interpreter's dot accumulate each element over k in order (as the GPU does),
    and its fp32 -> bf16 casts round to nearest even (as the GPU's do)."""
    import numpy as np
    import triton.language as tl  # type: ignore[import-untyped]
    import triton.runtime.interpreter as interp  # type: ignore[import-untyped]

    def values(h):  # type: ignore[no-untyped-def]
        if h.dtype.scalar == tl.bfloat16:  # the interpreter keeps bf16 as its uint16 bits
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        acc = d.data.copy()
        lhs, rhs = values(a).astype(acc.dtype), values(b).astype(acc.dtype)
        for k in range(lhs.shape[-1]):
            acc = acc + lhs[..., :, k : k + 1] * rhs[..., k : k + 1, :]
        return interp.TensorHandle(np.asarray(acc), d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot
    convert = interp._convert_float

    def convert_float(data, src, dst, rounding_mode):  # type: ignore[no-untyped-def]
        # fp32 -> bf16 rounds to nearest even, as the GPU's cvt.rn does (the interpreter's own
        # conversion truncates, or with "rtne" rounds half up and loses a mantissa carry)
        if src == tl.float32 and dst == tl.bfloat16:
            bf = torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16)
            return bf.view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding_mode)

    interp._convert_float = convert_float


if RUN_HERE and not ON_CUDA:
    _sequential_dot()


@pytest.mark.skipif(RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-500:]
    assert "failed" not in r.stdout, r.stdout[-500:]


def test_cpu_strict_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "from posttrain.models import ModelConfig, build_model, StrictOps\n"
        "m = build_model(ModelConfig.tiny(max_position_embeddings=16), 0)\n"
        "assert m.ops is StrictOps\n"
        "m.forward_logprobs(torch.tensor([1, 2, 3, 4]), [2, 2])\n"
        "m.decode_step(m.new_kv_cache(1), [0], [5])\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_strict_kernels_setting_is_checked() -> None:
    from posttrain.models import ModelInputError, StrictOps

    model = build_model(ModelConfig.tiny(max_position_embeddings=16), 0, strict_kernels="torch")
    assert model.ops is StrictOps
    with pytest.raises(ModelInputError, match="strict_kernels"):
        model.strict_kernels = "cuda"  # type: ignore[assignment]


# ------------------------------------------------------------------ kernels


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if ON_CUDA else "cpu"


def _rel(out: Tensor, ref: Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


@kernel_test
def test_linear_is_accurate_and_row_invariant(device: str) -> None:
    from posttrain.models._strict_cuda import CudaStrictOps as Ops

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 40, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(50, 40, generator=gen).to(dtype)
        full = Ops.linear(x.to(device), w.to(device))
        # a bf16 weight makes a bf16 dot: the activation is rounded to bf16, products exact,
        # the sum fp32 (so fp32-accurate against the rounded operands)
        xr = x.to(dtype).double()
        assert _rel(full, xr @ w.double().T) < 1e-6
        if dtype == torch.bfloat16:
            assert _rel(full, x.double() @ w.double().T) > 1e-4  # it did round the activation
        one = Ops.linear(x[37:38].to(device), w.to(device))
        part = Ops.linear(x[3:40].to(device), w.to(device))
        perm = torch.randperm(70, generator=gen)
        assert torch.equal(one[0], full[37])
        assert torch.equal(part, full[3:40])
        assert torch.equal(Ops.linear(x[perm].to(device), w.to(device)), full[perm])
    # strided operands (a transposed weight, as rel_logits_of passes) and a 3-D input
    w = torch.randn(40, 24, generator=gen)
    out = Ops.linear(x.reshape(7, 10, 40).to(device), w.to(device).t())
    assert out.shape == (7, 10, 24)
    assert _rel(out.reshape(70, 24), x.double() @ w.double()) < 1e-6


@kernel_test
def test_row_kernels_are_accurate_and_row_invariant(device: str) -> None:
    from posttrain.models._strict_cuda import CudaStrictOps as Ops

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, 1100, generator=gen) * 3  # rows longer than one block
    xd = x.to(device)
    w = torch.rand(1100, generator=gen) + 0.5
    per_head = torch.rand(4, 1100, generator=gen) + 0.5
    xx = x.double()
    for weight in (w, per_head):
        ref = xx * torch.rsqrt(xx.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
        got = Ops.rms_norm(xd, weight.to(device), 1e-6)
        assert _rel(got, ref) < 1e-6
        assert torch.equal(Ops.rms_norm(xd[4:5], weight.to(device), 1e-6)[0], got[4])
    for fn, ref in (
        (Ops.softmax, torch.softmax(xx, -1)),
        (Ops.log_softmax, torch.log_softmax(xx, -1)),
    ):
        got = fn(xd)
        assert _rel(got, ref) < 1e-6
        assert torch.equal(fn(xd[2:3, 1:2])[0, 0], got[2, 1])
    gu = torch.randn(6, 2, 33, generator=gen).to(device)
    act = Ops.silu_mul(gu[:, 0], gu[:, 1])
    ref = torch.nn.functional.silu(gu[:, 0].double().cpu()) * gu[:, 1].double().cpu()
    assert _rel(act, ref) < 1e-6


def _reference_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int], scale: float, window: int | None
) -> Tensor:
    """fp64 masked attention per packed segment: ``[T, heads * hd]``."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qs = q[start : start + n].double()
        ks = k[start : start + n].double().repeat_interleave(group, 1)
        vs = v[start : start + n].double().repeat_interleave(group, 1)
        s = torch.einsum("thd,chd->htc", qs, ks) * scale
        dist = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        seen = dist >= 0 if window is None else (dist >= 0) & (dist < window)
        probs = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
        outs.append(torch.einsum("htc,chd->thd", probs, vs).reshape(n, -1))
        start += n
    return torch.cat(outs)


@kernel_test
@pytest.mark.parametrize(
    ("window", "precision"),
    [(None, "auto"), (7, "auto"), (7, "tf32x3"), (None, "bf16"), (7, "bf16")],
)
def test_attention_train_rows_equal_decode_rows(
    device: str, window: int | None, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from posttrain.models import _triton_kernels as kernels
    from posttrain.models._strict_cuda import CudaStrictOps as Ops

    tiling = dataclasses.replace(kernels.ATTENTION_TILING, precision=precision)
    monkeypatch.setattr(Ops, "attention_tiling", tiling)

    gen = torch.Generator().manual_seed(2)
    lengths, cap, heads, kv_heads, hd = [5, 70, 1], 80, 4, 2, 8  # 70 > one 64-slot block
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, hd, generator=gen) for h in (heads, kv_heads, kv_heads))
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    first = torch.arange(t) - pos
    dev = [x.to(device) for x in (q, k, v, first, pos)]
    train = Ops.attend_rows(*dev, scale=0.3, window=window)
    tolerance = 1e-2 if precision == "bf16" else 1e-6  # bf16 operands in both dots
    assert _rel(train, _reference_attention(q, k, v, lengths, 0.3, window)) < tolerance
    # decode: each query alone over its row of a cache of capacity ``cap`` (stale slots random)
    kbuf = torch.randn(3, cap, kv_heads, hd, generator=gen)
    vbuf = torch.randn(3, cap, kv_heads, hd, generator=gen)
    kbuf[seg, pos], vbuf[seg, pos] = k, v
    flat_k, flat_v = kbuf.reshape(-1, kv_heads, hd).to(device), vbuf.reshape(-1, kv_heads, hd)
    for i in (0, 4, 5, 37, 74, 75):
        got = Ops.attend_rows(
            q[i : i + 1].to(device),
            flat_k,
            flat_v.to(device),
            (seg[i : i + 1] * cap).to(device),
            pos[i : i + 1].to(device),
            scale=0.3,
            window=window,
        )
        assert torch.equal(got[0], train[i]), i


@kernel_test
def test_backward_matches_torch_autograd(device: str) -> None:
    from posttrain.models import FastOps
    from posttrain.models._strict_cuda import CudaStrictOps as Ops

    gen = torch.Generator().manual_seed(3)

    def grads(fn: object, *xs: Tensor) -> list[Tensor]:
        leaves = [x.detach().to(device).requires_grad_() for x in xs]
        out = fn(*leaves)  # type: ignore[operator]
        weight = torch.randn(out.shape, generator=gen).to(device)
        (out * weight).sum().backward()
        return [leaf.grad.cpu() for leaf in leaves]  # type: ignore[union-attr]

    def same(name: str, a: list[Tensor], b: list[Tensor]) -> None:
        for x, y in zip(a, b, strict=True):
            assert float((x - y).norm() / y.norm()) < 1e-5, name

    x, w = torch.randn(9, 12, generator=gen), torch.randn(7, 12, generator=gen)
    gen_state = gen.get_state()
    got = grads(Ops.linear, x, w)
    gen.set_state(gen_state)
    same("linear", got, grads(FastOps.linear, x, w))
    hn = torch.rand(3, 12, generator=gen) + 0.5
    for name, fn, ref, args in (
        ("rms", lambda a, b: Ops.rms_norm(a, b, 1e-6), lambda a, b: FastOps.rms_norm(a, b, 1e-6),
         (torch.randn(5, 3, 12, generator=gen), hn)),
        ("silu", Ops.silu_mul, FastOps.silu_mul, (x, torch.randn(9, 12, generator=gen))),
        ("softmax", Ops.softmax, FastOps.softmax, (x,)),
        ("log_softmax", Ops.log_softmax, FastOps.log_softmax, (x,)),
    ):  # fmt: skip
        gen_state = gen.get_state()
        got = grads(fn, *args)
        gen.set_state(gen_state)
        same(name, got, grads(ref, *args))
    lengths = [6, 11]
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, 8, generator=gen) for h in (4, 2, 2))
    pos = torch.cat([torch.arange(n) for n in lengths])
    first = (torch.arange(t) - pos).to(device)

    def fused(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return Ops.attend_rows(q, k, v, first, pos.to(device), scale=0.4, window=4)

    def dense(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = _reference_attention(q.cpu(), k.cpu(), v.cpu(), lengths, 0.4, 4)
        return out.float().to(q.device)

    gen_state = gen.get_state()
    got = grads(fused, q, k, v)
    gen.set_state(gen_state)
    same("attention", got, grads(dense, q, k, v))

    # bf16 kernels (a bf16 weight, CudaStrictBf16Ops' attention): bf16 operands, so bf16's
    # accuracy against the fp32 autograd of the same math
    from posttrain.models._strict_cuda import CudaStrictBf16Ops

    def near(name: str, a: list[Tensor], b: list[Tensor]) -> None:
        for x, y in zip(a, b, strict=True):
            assert float((x - y).norm() / y.norm()) < 2e-2, name

    wb = w.to(torch.bfloat16)
    gen_state = gen.get_state()
    got = grads(Ops.linear, x, wb)
    gen.set_state(gen_state)
    near("bf16 linear", got, grads(lambda a, b: FastOps.linear(a, b.float()), x, wb))

    def fused_bf16(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return CudaStrictBf16Ops.attend_rows(q, k, v, first, pos.to(device), scale=0.4, window=4)

    gen_state = gen.get_state()
    got = grads(fused_bf16, q, k, v)
    gen.set_state(gen_state)
    near("bf16 attention", got, grads(dense, q, k, v))


def _routing(t: int, k: int, experts: Sequence[int], gen: torch.Generator) -> Tensor:
    """``ids[t, k]``: each token's ``k`` distinct experts from ``experts``, ascending."""
    pool = torch.tensor(experts)
    rows = [pool[torch.randperm(len(experts), generator=gen)[:k]].sort().values for _ in range(t)]
    return torch.stack(rows)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_rows_are_linear_rows(device: str, dtype: torch.dtype) -> None:
    from posttrain.models import _triton_kernels as kernels
    from posttrain.models._expert_rows import expert_rows, pair_rows, source_rows, tile_experts

    gen = torch.Generator().manual_seed(6)
    tiling = kernels.BF16_LINEAR_TILING if dtype == torch.bfloat16 else kernels.LINEAR_TILING
    t, k, e, kdim, n = 37, 2, 5, 40, 24
    x = torch.randn(t, kdim, generator=gen).to(device)
    w = torch.randn(e, n, kdim, generator=gen).to(dtype).to(device)
    ids = _routing(t, k, [0, 1, 2, 4], gen).to(device)  # expert 3 idle
    layout = expert_rows(ids, e, tiling.block_m)
    tiles = tile_experts(layout, tiling.block_m)
    assert layout.rows % tiling.block_m == 0
    assert int(tiles.min()) == -1  # a tail of dead tiles
    out = torch.full((t * k, n), float("nan"), device=device)
    kernels.grouped_linear(
        x, w, tiles, rows=layout.rows, src=source_rows(layout, k), dst=pair_rows(layout),
        out=out, tiling=tiling,
    )  # fmt: skip
    xp = torch.zeros(layout.rows, kdim, device=device)
    xp.index_copy_(0, layout.dest, x[layout.order // k])  # the pairs' rows, padded
    padded = torch.full((layout.rows, n), float("nan"), device=device)
    kernels.grouped_linear(xp, w, tiles, rows=layout.rows, out=padded, tiling=tiling)
    flat = ids.reshape(-1)
    for j in range(e):
        pairs = (flat == j).nonzero()[:, 0]
        if pairs.numel() == 0:
            continue
        ref = kernels.linear(x[pairs // k], w[j], tiling)  # the expert's rows, alone
        assert torch.equal(out[pairs], ref), j
        assert torch.equal(padded[layout.row_of_pair[pairs]], ref), j
    end = int(layout.ends[-1])
    pad = torch.ones(layout.rows, dtype=torch.bool, device=device)
    pad[layout.row_of_pair] = False
    pad[end:] = False
    assert torch.equal(padded[pad], torch.zeros_like(padded[pad]))  # a group's pad rows: zero
    assert bool(padded[end:].isnan().all())  # the tiles past the last group: never written


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_equal_the_expert_loop(device: str, dtype: torch.dtype) -> None:
    from posttrain.models._strict_cuda import CudaStrictBf16Ops, CudaStrictOps

    ops = CudaStrictBf16Ops if dtype == torch.bfloat16 else CudaStrictOps
    gen = torch.Generator().manual_seed(7)
    t, k, e, h, inter = 29, 2, 6, 24, 16
    m = torch.randn(t, h, generator=gen)
    fc1 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.3).to(dtype)
    fc2 = (torch.randn(e, h, inter, generator=gen) * 0.3).to(dtype)
    ids = _routing(t, k, [0, 1, 3, 4, 5], gen)  # expert 2 idle

    def loop(m: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor:
        out = m.new_zeros(t, k, h)
        for j in range(e):
            tok, slot = (ids.to(m.device) == j).nonzero(as_tuple=True)
            if tok.numel():
                act = ops.silu_mul_halves(ops.linear(m[tok], fc1[j]))
                out = out.index_put((tok, slot), ops.linear(act, fc2[j]))
        return out

    def fused(m: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor:
        out = ops.routed_experts(m, ids.to(m.device), fc1, fc2)
        assert out is not None
        return out

    args = [a.to(device) for a in (m, fc1, fc2)]
    with torch.no_grad():
        assert torch.equal(fused(*args), loop(*args))  # decode's call: the loop's bits
    results = []
    weight = torch.randn(t, k, h, generator=gen).to(device)
    for fn in (fused, loop):
        leaves = [a.detach().clone().requires_grad_() for a in args]
        out = fn(*leaves)
        (out * weight).sum().backward()
        results.append((out.detach(), [leaf.grad for leaf in leaves]))
    (out_f, grads_f), (out_l, grads_l) = results
    assert torch.equal(out_f, out_l)  # training's call: the same bits
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 operands in the backward
    for name, a, b in zip(("m", "fc1", "fc2"), grads_f, grads_l, strict=True):
        assert a is not None, name
        assert b is not None, name
        assert a.dtype == b.dtype, name
        assert float((a.float() - b.float()).norm() / b.float().norm()) < tolerance, name
    assert torch.equal(grads_f[1][2], torch.zeros_like(grads_f[1][2]))  # the idle expert


@kernel_test
def test_routed_experts_backward_without_grouped_mm(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from posttrain.models import _strict_cuda
    from posttrain.models._strict_cuda import CudaStrictBf16Ops as Ops

    gen = torch.Generator().manual_seed(10)
    t, k, e, h, inter = 17, 2, 4, 16, 8
    m = torch.randn(t, h, generator=gen).to(device)
    fc1 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.3).to(torch.bfloat16).to(device)
    fc2 = (torch.randn(e, h, inter, generator=gen) * 0.3).to(torch.bfloat16).to(device)
    ids = _routing(t, k, list(range(e)), gen).to(device)
    weight = torch.randn(t, k, h, generator=gen).to(device)

    def grads() -> list[Tensor]:
        leaves = [a.detach().clone().requires_grad_() for a in (m, fc1, fc2)]
        out = Ops.routed_experts(leaves[0], ids, leaves[1], leaves[2])
        assert out is not None
        (out * weight).sum().backward()
        return [leaf.grad for leaf in leaves]  # type: ignore[misc]

    grouped = grads()

    def broken(*args: object, **kwargs: object) -> Tensor:
        raise RuntimeError("no grouped GEMM here")

    monkeypatch.setattr(_strict_cuda, "_GROUPED_MM_FAILED", [])
    monkeypatch.setattr(torch, "_grouped_mm", broken)
    with pytest.warns(RuntimeWarning, match="one matmul per expert"):
        looped = grads()
    assert _strict_cuda._GROUPED_MM_FAILED  # remembered: later calls go straight to the loop
    for a, b in zip(grouped, looped, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2


@kernel_test
def test_silu_mul_halves_backward(device: str) -> None:
    from posttrain.models import FastOps
    from posttrain.models._strict_cuda import CudaStrictOps as Ops

    gen = torch.Generator().manual_seed(8)
    gu = torch.randn(11, 2 * 40, generator=gen)
    weight = torch.randn(11, 40, generator=gen)
    grads = []
    for fn in (Ops.silu_mul_halves, FastOps.silu_mul_halves):
        leaf = gu.clone().to(device).requires_grad_()
        out = fn(leaf)
        (out * weight.to(device)).sum().backward()
        grads.append((out.detach().cpu(), leaf.grad.cpu()))  # type: ignore[union-attr]
    (out, grad), (ref_out, ref_grad) = grads
    assert torch.equal(out, Ops.silu_mul(gu[:, :40].to(device), gu[:, 40:].to(device)).cpu())
    assert float((out - ref_out).norm() / ref_out.norm()) < 1e-6
    assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-6


@kernel_test
@pytest.mark.parametrize("norm", ["none", "shared", "per_head"])
def test_norm_rope_is_norm_then_rope(device: str, norm: str) -> None:
    from posttrain.models import FastOps
    from posttrain.models._strict_cuda import CudaStrictOps as Ops

    gen = torch.Generator().manual_seed(9)
    t, heads, hd = 13, 3, 16
    qkv = torch.randn(t, heads * hd + 8, generator=gen) * 2
    x = qkv[:, : heads * hd].reshape(t, heads, hd)  # a strided slice, as attention's q
    weight = {
        "none": None,
        "shared": torch.rand(hd, generator=gen) + 0.5,
        "per_head": torch.rand(heads, hd, generator=gen) + 0.5,
    }[norm]
    angle = torch.rand(t, hd // 2, generator=gen) * 6
    cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1)
    grads, outs = [], []
    upstream = torch.randn(t, heads, hd, generator=gen)
    for ops in (Ops, FastOps):
        leaves = [a.clone().to(device).requires_grad_() for a in (x, *(() if weight is None else (weight,)))]  # fmt: skip
        w = leaves[1] if weight is not None else None
        out = ops.norm_rope(leaves[0], w, 1e-6, cos.to(device), sin.to(device))
        (out * upstream.to(device)).sum().backward()
        outs.append(out.detach().cpu())
        grads.append([leaf.grad.cpu() for leaf in leaves])  # type: ignore[union-attr]
    assert float((outs[0] - outs[1]).norm() / outs[1].norm()) < 1e-6
    for a, b in zip(*grads, strict=True):
        assert float((a - b).norm() / b.norm()) < 1e-5
    with torch.no_grad():  # a row's bits are its own: one token alone, and all of them
        dev_x, wd = x.to(device), None if weight is None else weight.to(device)
        full = Ops.norm_rope(dev_x, wd, 1e-6, cos.to(device), sin.to(device))
        one = Ops.norm_rope(dev_x[5:6], wd, 1e-6, cos[5:6].to(device), sin[5:6].to(device))
        assert torch.equal(one[0], full[5])
        assert torch.equal(full.cpu(), outs[0])


# ------------------------------------------------------------------ the model


def _adapter(model: DecoderModel, device: str) -> LoraAdapter:
    gen = torch.Generator().manual_seed(5)
    targets = model.lora_targets()
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.2.down_proj", "lm_head"]
    names = [n for n in names if n in targets]
    weights = {}
    for n in names:
        d_in, d_out = targets[n]
        weights[n] = (
            (torch.randn(4, d_in, generator=gen) * 0.3).to(device),
            (torch.randn(d_out, 4, generator=gen) * 0.3).to(device),
        )
    return LoraAdapter(weights=weights, scaling=2.0, name="a")


CONFIGS = {
    "moe_lora": ModelConfig.tiny(max_position_embeddings=40, num_hidden_layers=2),
    "dense_window_bf16": ModelConfig.tiny(
        max_position_embeddings=40,
        mlp_only_layers=(0, 1),
        num_hidden_layers=2,
        sliding_window_layers=(1,),
        sliding_window_size=5,
        torch_dtype="bfloat16",
    ),
    "inkling": ModelConfig.inkling_tiny(
        max_position_embeddings=40, num_hidden_layers=2, sliding_window_layers=(0,)
    ),
}


@kernel_test
@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_train_equals_decode_bit_for_bit(device: str, name: str) -> None:
    from posttrain.models._strict_cuda import CudaStrictBf16Ops, CudaStrictOps

    cfg = CONFIGS[name]
    model = build_model(cfg, 0, strict_kernels="triton").to(device)
    low = cfg.torch_dtype == "bfloat16"  # bf16 weights: bf16 dots (activations rounded)
    assert model.ops is (CudaStrictBf16Ops if low else CudaStrictOps)
    gen = torch.Generator().manual_seed(6)
    segs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (7, 11)]
    lora = None
    if name == "moe_lora":
        lora = [_adapter(model, device), None]
    train = packed_logprobs(model, segs, lora=lora)
    assert torch.equal(train, decoded_logprobs(model, segs, [3, 6], lora=lora))
    reference = build_model(cfg, 0)  # CPU StrictOps (fp32 activations): close, not the same bits
    gap = (train - packed_logprobs(reference, segs, lora=_cpu_lora(lora))).abs().max()
    assert gap < (5e-2 if low else 1e-4), float(gap)


def _cpu_lora(lora: list[LoraAdapter | None] | None) -> list[LoraAdapter | None] | None:
    if lora is None:
        return None
    return [
        None
        if a is None
        else LoraAdapter(
            weights={n: (x.cpu(), y.cpu()) for n, (x, y) in a.weights.items()},
            scaling=a.scaling,
            name=a.name,
        )
        for a in lora
    ]


@kernel_test
def test_model_backward_matches_cpu_strict(device: str) -> None:
    cfg = CONFIGS["moe_lora"]
    segs = [[5, 9, 2, 7, 1, 8, 3], [4, 4, 6, 2, 9]]
    ids = torch.tensor([t for s in segs for t in s])
    grads = []
    for model in (build_model(cfg, 0, strict_kernels="triton").to(device), build_model(cfg, 0)):
        logprobs = model.forward_logprobs(ids, [7, 5])
        with torch.no_grad():  # the trainer's forward (autograd) == the engine's, bit for bit
            assert torch.equal(logprobs.detach(), model.forward_logprobs(ids, [7, 5]))
        logprobs.sum().backward()
        grads.append({n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[1].items():
        assert float((grads[0][n] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-7, n


@kernel_test
def test_mla_strict_train_equals_expanded_decode(device: str) -> None:
    """MLA (``_mla``) on the Triton kernels: heads zero-padded to one width for ``attend_rows``
    (v_head_dim 6 < qk_head_dim 12), training == expanded decode bit for bit, CPU-strict close."""
    from posttrain.models import PackedLayout, StrictOps
    from posttrain.models._mla import MlaAttention
    from posttrain.models._mla_cache import MlaCache
    from posttrain.models._mla_config import MlaSpec
    from posttrain.models._strict_cuda import CudaStrictOps

    spec = MlaSpec(hidden_size=32, num_heads=4, q_lora_rank=12, kv_lora_rank=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)  # fmt: skip
    module = MlaAttention(spec)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    cpu_module, module = module, MlaAttention(spec).to(device)
    module.load_hf_state_dict({k: v.to(device) for k, v in cpu_module.hf_state_dict().items()})
    lengths, cap = [9, 5], 16
    x = torch.randn(sum(lengths), 32, generator=gen)
    seg = torch.tensor([0] * 9 + [1] * 5)
    pos = torch.cat([torch.arange(9), torch.arange(5)])
    cos_t, sin_t = spec.rope_tables(cap)
    outs = {}
    for name, ops, m in (("cuda", CudaStrictOps, module), ("cpu", StrictOps, cpu_module)):
        dev = next(m.parameters()).device
        layout = PackedLayout(seg.to(dev), pos.to(dev), 2, cap)
        with torch.no_grad():
            outs[name] = m.forward_packed(
                ops, x.to(dev), layout, cos=cos_t[pos].to(dev), sin=sin_t[pos].to(dev)
            ).cpu()
    assert float((outs["cuda"] - outs["cpu"]).abs().max()) < 1e-5
    cache = MlaCache(spec, 1, 2, cap, device=device)
    done, got = [0, 0], [[], []]
    while live := [j for j in (0, 1) if done[j] < lengths[j]]:
        n = 4 if done == [0, 0] else 1
        parts = [x.split(lengths)[j][done[j] : done[j] + n] for j in live]
        rows, p = cache.placement(live, [len(q) for q in parts])
        with torch.no_grad():
            y = module.forward_cached(CudaStrictOps, torch.cat(parts).to(device), cache, 0,
                                      rows=rows, pos=p, cos=cos_t[p.cpu()].to(device),
                                      sin=sin_t[p.cpu()].to(device))  # fmt: skip
        cache.advance(live, [len(q) for q in parts])
        for j, piece in zip(live, y.cpu().split([len(q) for q in parts]), strict=True):
            got[j].append(piece)
            done[j] += len(piece)
    assert torch.equal(torch.cat([torch.cat(g) for g in got]), outs["cuda"])


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_backward_equals_the_per_run_loop(
    window: int | None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched backward of the packed training layout (segments padded to the longest)
    gives the per-run loop's gradients (pure torch: runs without CUDA or the interpreter)."""
    from posttrain.models import _row_attention as rows

    gen = torch.Generator().manual_seed(8)
    lengths, heads, kv_heads, hd = [5, 70, 1, 33], 4, 2, 8
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, hd, generator=gen) for h in (heads, kv_heads, kv_heads))
    out, grad = torch.randn(t, heads, hd, generator=gen), torch.randn(t, heads, hd, generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    kstart = torch.arange(t) - pos
    args = (q, k, v, kstart, pos, out, grad, 0.3, window, dtype)
    assert rows._packed_runs(q, k, kstart, pos) is not None
    batched = rows.row_attention_backward(*args)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    given = rows.row_attention_backward(*args, rows.PackedRuns(seg, len(lengths), max(lengths)))
    for a, b in zip(given, batched, strict=True):  # the caller's host facts: no read-back
        assert torch.equal(a, b)
    monkeypatch.setattr(rows, "_packed_runs", lambda *a: None)
    loop = rows.row_attention_backward(*args)
    _same_gradients(batched, loop, dtype)
    # a layout that is not packed training (decode-style key rows) keeps the loop
    assert rows._packed_runs(q, k, kstart + 1, pos) is None
    assert rows._packed_runs(q[:-1], k, kstart[:-1], pos[:-1]) is None


@kernel_test  # in the interpreter's own process here: CPU SDPA starts OpenMP's thread pool, kept
# out of pytest's process, which later tests fork ranks from (not the fleet test's hang: that was
# an in-process run's leftover TCPStore and gloo threads)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_attention_backward_through_sdpa(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packed backward through torch's fused attention (what CUDA runs) gives the batched
    einsums' gradients (pure torch: on CPU with ``"cpu"`` added to its devices)."""
    from posttrain.models import _row_attention as rows

    gen = torch.Generator().manual_seed(11)
    lengths, heads, kv_heads, hd = [5, 70, 1, 33], 4, 2, 8
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, hd, generator=gen) for h in (heads, kv_heads, kv_heads))
    out = _reference_attention(q, k, v, lengths, 0.3, None).float().reshape(t, heads, hd)
    grad = torch.randn(t, heads, hd, generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    args = (q, k, v, torch.arange(t) - pos, pos, out, grad, 0.3, None, dtype)
    monkeypatch.setattr(rows, "SDPA_BACKWARD_DEVICES", ("cpu",))
    fused = rows.row_attention_backward(*args)
    monkeypatch.setattr(rows, "SDPA_BACKWARD_DEVICES", ())
    einsums = rows.row_attention_backward(*args)
    _same_gradients(fused, einsums, dtype)


def _same_gradients(got: Sequence[Tensor], ref: Sequence[Tensor], dtype: torch.dtype) -> None:
    """``(dq, dk, dv)`` of two attention backwards: same dtypes and shapes, equal to fp32
    rounding (bf16's where the matmuls took bf16 operands)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert float((a - b).norm() / b.norm()) < tol, name
