"""The fused C strict linear forward (``posttrain.models._ckernel``) against torch's strict path.

Bit for bit on every shape the models meet and on the values that expose a reordered or
contracted sum (signed zeros, infinities, NaNs, denormals); the torch fallback when there is
no compiler; two processes compiling into one empty cache."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.models import StrictOps, _ckernel, _ops

_SHAPES = [
    (1, 1, 1),
    (0, 8, 5),
    (1, 3, 7),
    (3, 1, 65),
    (5, 2, 2),
    (7, 5, 63),
    (4, 17, 130),
    (13, 100, 64),
    (33, 96, 33),
    (2, 1000, 129),
    (3, 4096, 5),
]


def _default_nan() -> int:
    """The bits of the NaN this CPU makes from ``inf * 0``: the only NaN the exact tests use, so
    any two NaNs that meet are the same bits (which one wins then is the hardware's choice)."""
    return int((torch.tensor([float("inf")]) * torch.tensor([0.0])).view(torch.int32).item())


def _special(shape: tuple[int, int], gen: torch.Generator, nan_bits: list[int]) -> torch.Tensor:
    """Normal values with signed zeros, infinities, NaNs (of ``nan_bits``) and denormals."""
    x = torch.randn(shape, generator=gen)
    u = torch.rand(shape, generator=gen)
    x[u < 0.03] = -0.0
    x[(u >= 0.03) & (u < 0.05)] = 0.0
    x[(u >= 0.05) & (u < 0.055)] = float("inf")
    x[(u >= 0.055) & (u < 0.06)] = float("-inf")
    x[(u >= 0.06) & (u < 0.1)] *= 1e-39  # denormal
    bits = x.view(torch.int32)
    for j, nan in enumerate(nan_bits):
        bits[(u >= 0.1 + 0.005 * j) & (u < 0.105 + 0.005 * j)] = nan
    return x


def _torch_rows(
    rows: torch.Tensor, w_t: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    """``_strict_linear_rows`` on torch's kernels (the C kernel switched off for the call)."""
    with monkeypatch.context() as m:
        m.setattr(_ckernel, "strict_linear", lambda rows, w: None)
        return _ops._strict_linear_rows(rows, w_t)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(autouse=True)
def _kernel(request: pytest.FixtureRequest) -> None:
    """The kernel must build wherever there is a C compiler (a failed build is a bug); without
    one, only the fallback's test runs."""
    if request.node.name.startswith("test_no_compiler") or _ckernel.library() is not None:
        return
    if _ckernel._compiler() is None:
        pytest.skip("no C compiler here: the fused strict kernel cannot be built")
    pytest.fail("the fused strict kernel did not build here (see the logged warning)")


@pytest.mark.parametrize(("r", "k", "n"), _SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_fused_linear_bits_equal_torch(
    r: int, k: int, n: int, special: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(r * 7919 + k * 31 + n)
    if special:
        nan = [_default_nan()]
        rows, w = _special((r, k), gen, nan), _special((n, k), gen, nan)
    else:
        rows, w = torch.randn(r, k, generator=gen), torch.randn(n, k, generator=gen)
    w_t = w.t().contiguous()[:, None, :]
    fused = _ckernel.strict_linear(rows, w_t)
    assert fused is not None
    assert _same_bits(fused, _torch_rows(rows, w_t, monkeypatch))
    assert _same_bits(_ops._strict_linear_rows(rows, w_t), fused)


def test_fused_linear_nans_where_torch_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaNs of both signs and other payloads: every non-NaN bit is torch's and every NaN is a
    NaN (when two different NaNs meet, which comes out is the CPU's and the compiler's operand
    order, which torch's own kernels do not fix either: its vectorised multiply and its scalar
    tail pick differently)."""
    gen = torch.Generator().manual_seed(5)
    nans = [0x7FC00000, -4194304, 0x7FC01234]
    for r, k, n in [(5, 36, 101), (16, 256, 149), (9, 215, 88)]:
        rows, w = _special((r, k), gen, nans), _special((n, k), gen, nans)
        w_t = w.t().contiguous()[:, None, :]
        fused = _ckernel.strict_linear(rows, w_t)
        ref = _torch_rows(rows, w_t, monkeypatch)
        assert fused is not None
        assert torch.equal(fused.isnan(), ref.isnan())
        assert ref.isnan().any()
        keep = ~ref.isnan()
        assert torch.equal(fused[keep].view(torch.int32), ref[keep].view(torch.int32))


def test_fused_linear_takes_strided_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(11)
    big = torch.randn(20, 90, generator=gen)
    rows = big[::3, 5:75]  # [7, 70], strided
    w_t = torch.randn(41, 70, generator=gen).t()[:, None, :]  # [70, 1, 41], strided
    fused = _ckernel.strict_linear(rows, w_t)
    assert fused is not None
    assert _same_bits(fused, _torch_rows(rows, w_t, monkeypatch))


def test_strict_linear_forward_and_gradients_keep_their_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``StrictOps.linear`` (no grad, the custom autograd function, autograd's reference graph)
    gives torch's forward bits through the fused kernel; autograd's reference path never takes
    it, and the gradients are the reference's to fp32 rounding."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 50, 96, generator=gen)
    w = torch.randn(72, 96, generator=gen)
    with monkeypatch.context() as m:
        m.setattr(_ckernel, "strict_linear", lambda rows, w: None)
        ref = StrictOps.linear(x, w)
    with torch.no_grad():
        assert _same_bits(StrictOps.linear(x, w), ref)
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = StrictOps.linear(xg, wg)
    assert _same_bits(out.detach(), ref)
    out.backward(torch.ones_like(out))
    calls: list[bool] = []  # per call: whether the fused kernel ran
    real = _ckernel.strict_linear

    def counted(rows: torch.Tensor, w_kn: torch.Tensor) -> torch.Tensor | None:
        out = real(rows, w_kn)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(_ops, "_CUSTOM_BACKWARD", False)
    monkeypatch.setattr(_ckernel, "strict_linear", counted)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out_r = StrictOps.linear(xr, wr)
    assert _same_bits(out_r.detach(), ref)
    out_r.backward(torch.ones_like(out_r))
    assert xr.grad is not None
    assert xg.grad is not None
    # the custom backward is BLAS's: autograd's reference gradients to fp32 rounding
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-4, atol=1e-5)
    assert wr.grad is not None
    assert wg.grad is not None
    torch.testing.assert_close(wg.grad, wr.grad, rtol=1e-4, atol=1e-5)
    assert calls
    assert not any(calls)


def test_no_compiler_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 33, generator=gen), torch.randn(19, 33, generator=gen)
    fused = StrictOps.linear(x, w)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(_ckernel.CACHE_ENV, str(tmp_path / "cache"))
    _ckernel.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="posttrain.models"):
            assert _ckernel.library() is None
            assert _ckernel.strict_linear(x, w.t()[:, None, :]) is None
            fallback = StrictOps.linear(x, w)
        warned = [r for r in caplog.records if "fused strict CPU kernel" in r.getMessage()]
        assert len(warned) == 1
        assert "no-such-cc" in warned[0].getMessage()
        assert _same_bits(fallback, fused)
        assert not any((tmp_path / "cache").glob("*.so"))
        monkeypatch.setenv(_ckernel.SWITCH_ENV, "0")
        monkeypatch.delenv("CC")
        _ckernel.library.cache_clear()
        assert _ckernel.library() is None  # switched off: no compile, no warning
        assert len([r for r in caplog.records if "fused strict" in r.getMessage()]) == 1
    finally:
        _ckernel.library.cache_clear()


def test_a_compiler_refusing_native_flags_builds_the_portable_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``-march=native`` is refused (an older or foreign compiler), the portable flags
    build the kernel instead: the same bits."""
    cc = tmp_path / "cc-without-native"
    real = subprocess.run(
        ["sh", "-c", "command -v cc || command -v gcc"], capture_output=True, text=True
    )
    cc.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -march=native ] && { echo refused >&2; exit 1; }; done\n'
        f'exec {real.stdout.strip()} "$@"\n'
    )
    cc.chmod(0o755)
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(9, 77, generator=gen), torch.randn(33, 77, generator=gen)
    native = StrictOps.linear(x, w)
    z = torch.randn(5000, generator=gen) * 30
    native_exp = _ops.exp_strict(z)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv(_ckernel.CACHE_ENV, str(tmp_path / "cache"))
    _ckernel.library.cache_clear()
    try:
        assert _ckernel.library() is not None
        assert _same_bits(StrictOps.linear(x, w), native)
        assert _same_bits(_ops.exp_strict(z), native_exp)
        assert len(list((tmp_path / "cache").glob("*.so"))) == 1
    finally:
        _ckernel.library.cache_clear()


def test_processes_compiling_into_one_empty_cache_both_load(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    script = (
        "from posttrain.models import _ckernel\n"
        "import torch\n"
        "lib = _ckernel.library()\n"
        "assert lib is not None, 'no library'\n"
        "x = torch.arange(12.0).reshape(3, 4)\n"
        "out = _ckernel.strict_linear(x, torch.ones(4, 1, 2))\n"
        "assert out is not None and out[:, 0].tolist() == [6.0, 22.0, 38.0], out\n"
    )
    env = {**os.environ, _ckernel.CACHE_ENV: str(cache)}
    env.pop(_ckernel.SWITCH_ENV, None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out.decode()
    files = [p.name for p in cache.iterdir()]
    assert [name.endswith(".so") for name in files] == [True], files  # no temporary left


@pytest.mark.parametrize(
    ("t", "nkv", "g", "c", "hd"), [(5, 2, 2, 64, 8), (3, 1, 3, 7, 5), (1, 2, 1, 1, 4)]
)
def test_attention_product_trees_keep_their_bits(
    t: int, nkv: int, g: int, c: int, hd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``StrictOps.attention`` (scores and probabilities times values through the fused kernel)
    gives torch's bits, with and without autograd, and the same gradients."""
    gen = torch.Generator().manual_seed(t * 100 + c)
    q = _special((t * nkv * g, hd), gen, [_default_nan()]).reshape(t, nkv, g, hd)
    q[0, 0, 0, 0] = float("nan")  # a NaN query: its row is NaN on both paths
    keys = torch.randn(t, c, nkv, hd, generator=gen)
    values = torch.randn(t, c, nkv, hd, generator=gen)
    valid = torch.rand(t, c, generator=gen) < 0.7
    valid[:, 0] = True
    bias = torch.randn(t, nkv, g, c, generator=gen)

    def run(fused: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as m:
            if not fused:  # torch's path as it was: contiguous operands, torch's products
                m.setattr(_ckernel, "product_tree", lambda a, b: None)
                m.setattr(_ckernel, "reads_views", lambda *tensors: False)
            with torch.no_grad():
                plain = StrictOps.attention(q, keys, values, valid, 0.35, bias)
            leaves = [x.clone().requires_grad_(True) for x in (q, keys, values)]
            out = StrictOps.attention(*leaves, valid, 0.35, bias)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
            return [plain, out.detach(), *(x.grad for x in leaves if x.grad is not None)]

    fused, reference = run(True), run(False)
    assert len(fused) == len(reference) == 5
    for a, b in zip(fused, reference, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(0.0).view(torch.int32), b.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize(("b", "r"), [(1, 300), (5, 40)])
def test_threads_split_the_work_without_changing_a_bit(b: int, r: int) -> None:
    gen = torch.Generator().manual_seed(b)
    x, w = torch.randn(b, r, 64, generator=gen), torch.randn(b, 64, 160, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ckernel.strict_matmul(x, w)
        torch.set_num_threads(3)
        several = _ckernel.strict_matmul(x, w)
    finally:
        torch.set_num_threads(threads)
    assert one is not None
    assert several is not None
    assert b * r * 64 * 160 >= _ckernel._PARALLEL_PRODUCTS  # the split ran
    assert _same_bits(one, several)


def test_product_tree_reads_strided_and_broadcast_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Permuted, sliced and expanded (stride 0) operands, read in place: torch's bits."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(6, 3, 2, 9, generator=gen)  # [T, nkv, g, hd]
    keys = torch.randn(6, 40, 3, 9, generator=gen)[:, ::2]  # [T, 20, nkv, hd], sliced
    a = q.permute(3, 0, 1, 2)[..., None]  # [hd, T, nkv, g, 1]
    b = keys.permute(3, 0, 2, 1)[:, :, :, None, :]  # [hd, T, nkv, 1, 20]
    shared = torch.randn(9, 1, 1, 1, 20, generator=gen).expand(9, 6, 3, 1, 20)
    for x, y in [(a, b), (a, shared)]:
        fused = _ckernel.product_tree(x, y)
        assert fused is not None
        assert _same_bits(fused, _ops._tree_sum_owned(x.contiguous() * y.contiguous()))


def test_exp_strict_keeps_its_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``exp_strict`` through the fused kernel: torch's bits over the clamp range and past it,
    signed zeros, infinities, denormals and NaN; its gradient unchanged."""
    gen = torch.Generator().manual_seed(21)
    edges = [0.0, -0.0, 88.5, -90.0, float("inf"), float("-inf"), 1e-40, 44.3614195558365]
    x = torch.cat([torch.randn(20000, generator=gen) * 30, torch.tensor(edges)]).reshape(-1, 8)
    x_nan = torch.cat([x.flatten(), torch.tensor([float("nan")])])
    fused = _ops.exp_strict(x)
    with monkeypatch.context() as m:
        m.setattr(_ckernel, "exp_strict", lambda x, coeffs: None)
        ref = _ops.exp_strict(x)
        ref_nan = _ops.exp_strict(x_nan)
        grads = _grad_of_exp(x)
    assert _same_bits(fused, ref)
    fused_nan = _ops.exp_strict(x_nan)
    assert fused_nan[-1].isnan()
    assert _same_bits(fused_nan[:-1], ref_nan[:-1])
    assert _same_bits(_grad_of_exp(x), grads)


def _grad_of_exp(x: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    _ops.exp_strict(leaf).backward(torch.linspace(-2.0, 2.0, x.numel()).reshape(x.shape))
    assert leaf.grad is not None
    return leaf.grad


@pytest.mark.parametrize(
    ("shape", "dim"), [((7, 101), -1), ((5, 3, 33), 1), ((64, 9), 0), ((1,), 0), ((4, 2, 1), -1)]
)
def test_tree_sum_keeps_its_bits(
    shape: tuple[int, ...], dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tree_sum`` (norms, softmaxes) through the fused kernel: torch's bits, any dim, with and
    without autograd (the gradient too)."""
    gen = torch.Generator().manual_seed(len(shape) * 10 + dim)
    x = _special((1, math.prod(shape)), gen, [_default_nan()]).reshape(shape)

    def run() -> list[torch.Tensor]:
        leaf = x.clone().requires_grad_(True)
        out = _ops.tree_sum(leaf, dim)
        out.backward(torch.ones_like(out))
        assert leaf.grad is not None
        return [_ops.tree_sum(x, dim), out.detach(), leaf.grad]

    fused = run()
    with monkeypatch.context() as m:
        m.setattr(_ckernel, "tree_sum", lambda x, dim: None)
        reference = run()
    assert all(_same_bits(a, b) for a, b in zip(fused, reference, strict=True))
