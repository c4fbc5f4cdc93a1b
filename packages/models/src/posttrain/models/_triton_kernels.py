# mypy: disable-error-code="untyped-decorator,no-untyped-def,no-any-return"
# ruff: noqa: N803  (Triton spells compile-time constants in capitals)
"""Triton kernels of the strict path on CUDA: batch invariant by a fixed shape per output row.

Imported only by ``_strict_cuda`` (itself imported only when a strict model runs on CUDA, or
by the interpreter tests), so CPU work never imports Triton. Every kernel computes an output
row from that row's inputs alone, with a reduction whose shape and order are compile-time
constants of the kernel (never a function of the number of rows):

* ``linear``: ``x[M, K] @ w[N, K].T`` with ONE tiling (``LINEAR_TILING``) for every ``M``, no
  split-K; rows past ``M`` in a tile are zeros that only feed rows past ``M``. ``w`` may be
  bf16/fp16/fp32: upcast in registers, exact, so the fp32 copy the torch path makes is never
  written. The dot's precision is part of the tiling: ``"tf32x3"`` (the default) splits each
  fp32 operand into a TF32 high part and a TF32 remainder and accumulates the three products
  ``hi*hi + hi*lo + lo*hi`` on the tensor cores in fp32 (near-fp32 accuracy: about 2**-22 per
  product instead of 2**-24); ``"ieee"`` is exact fp32 products on the FMA units. Both give
  each output element a fixed accumulation order for a fixed tiling. Measured on the H200
  (docs/benchmarks/models.md): ``ieee`` reaches 14-22 TFLOP/s, 0.28-0.44x cuBLAS fp32, too slow
  for the issue-26 target; ``tf32x3`` about 67 TFLOP/s, 1.3x cuBLAS fp32 (TF32 off).
  ``"bf16"`` (the default for a bf16 weight: ``BF16_LINEAR_TILING``) rounds the activation to
  bf16 in registers and makes one bf16 tensor-core pass per ``block_k`` into an fp32
  accumulator: what bf16 serving and bf16 training compute, at bf16 speed, with the same
  fixed order per output element.
* ``rms_norm``, ``softmax``, ``log_softmax``: one program per row, a fixed ``BLOCK`` loop over
  the row into a ``[BLOCK]`` accumulator, then one ``tl.sum``/``tl.max`` of fixed shape.
* ``row_attention``: queries over the keys of their row (see ``row_attention``'s doc): the
  packed training forward and KV-cache decode launch the same kernel with the same
  constexprs, so a query's keys are visited in the same blocks, in the same order, by the
  same instructions, on both paths.
* ``silu_mul``: elementwise.
* ``norm_rope``: one program per (token, head) row: an optional per-head RMSNorm (the fixed
  ``tl.sum`` over the padded row) and the rotate-half rope, in one pass.
* ``grouped_linear``: ``linear``'s loop for rows grouped by expert in whole tiles (a MoE
  layer's routed experts in one launch, no host sync): tile ``i`` multiplies by
  ``weight[tile_expert[i]]``; each row's reduction is the same fixed loop over ``K``.

Backward kernels (``rms_norm_backward``, ``silu_mul_backward``) have no bit contract beyond run
to run determinism (as every strict backward): they exist to replace chains of torch ops.

Transcendentals are Triton's ``exp``/``log`` (on NVIDIA: the hardware approximations behind
``ex2``/``lg2``, deterministic); divisions and square roots are ``div_rn``/``sqrt_rn``. So CUDA
strict bits differ from CPU strict bits (``exp_strict``/``tree_sum``) by design; what holds is
bit identity between the paths of one device (train == prefill == decode, any batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

__all__ = [
    "ATTENTION_TILING",
    "BF16_ATTENTION_TILING",
    "BF16_LINEAR_TILING",
    "LINEAR_TILING",
    "AttentionTiling",
    "LinearTiling",
    "grouped_linear",
    "linear",
    "norm_rope",
    "norm_rope_backward",
    "rms_norm",
    "rms_norm_backward",
    "row_attention",
    "silu_mul",
    "silu_mul_backward",
    "softmax",
]


@dataclass(frozen=True, slots=True)
class LinearTiling:
    """The one tiling of ``linear`` (independent of the number of rows: that is the point)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    precision: str = "tf32x3"
    """``tf32x3``, ``ieee`` or ``bf16`` (see the module doc)."""


@dataclass(frozen=True, slots=True)
class AttentionTiling:
    """The one tiling of ``row_attention``: ``block_m`` (token, head-in-group) rows per tile,
    ``block_n`` key slots per step. Train and decode must use the same one."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    precision: str = "auto"
    """Both dots: ``ieee`` (FMA units), ``tf32x3`` (tensor cores, as ``linear``), or ``auto``:
    ``ieee`` up to head dim 64, ``tf32x3`` above. The choice depends on the model only, so
    training and decode always share it. Why: Triton's FMA-path dot keeps a thread's operand
    rows over the whole head dim in registers; on the H200, ``ieee`` ran train == decode bit
    for bit at head dims 8 and 16 and the GRPO step at head dim 64, while the ~1B benchmark
    (head dim 128) did not finish in its time slot, spills suspected. ``tf32x3`` attention
    has not run on a GPU yet (docs/benchmarks/models.md)."""


LINEAR_TILING = LinearTiling()
BF16_LINEAR_TILING = LinearTiling(
    block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, precision="bf16"
)
"""The tiling of ``linear`` for a bf16 weight: one bf16 tensor-core pass per ``block_k``
(the activation rounded to bf16 in registers), what a bf16 serving engine computes."""
ATTENTION_TILING = AttentionTiling()
BF16_ATTENTION_TILING = AttentionTiling(precision="bf16")
"""The tiling of ``row_attention`` for a model with bf16 weights: both dots take bf16
operands (queries, keys, values and probabilities rounded to bf16) into fp32 accumulators."""
_ROW_BLOCK = 1024  # rms_norm / softmax block over a row
_EW_BLOCK = 1024  # silu_mul block


# --------------------------------------------------------------------------- linear


# M (rows) and T (tokens) are not specialised on: one binary serves every row count, so a
# row's instructions cannot depend on how many rows came with it (and decode's changing batch
# sizes compile nothing new).
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    src_ptr,
    dst_ptr,
    M,
    N,
    K,
    sxm,
    sxk,
    swe,
    swn,
    swk,
    som,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUPED: tl.constexpr,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
):
    # One kernel for ``linear`` and ``grouped_linear``: the constexprs below only choose which
    # tile a program takes, which weight it reads and where its rows come from and go; the loop
    # over K, and so every output row's bits, is the same code for both.
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    if GROUPED:  # tile pid_m multiplies by weight[tile_expert[pid_m]]; -1: no work, no store
        pid_m = pid // grid_n
        pid_n = pid % grid_n
        expert = tl.load(tile_expert_ptr + pid_m)
        live = expert >= 0
        k_end = tl.where(live, K, 0)
        w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * swe
    else:  # grouped program order (L2 reuse of w); it only decides which tile runs when
        live = True
        grid_m = tl.cdiv(M, BLOCK_M)
        width = GROUP_M * grid_n
        group = pid // width
        first_m = group * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        k_end = K
        w_base = w_ptr
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    if GATHER:  # row r of the tile reads x[src[r]] (-1: a zero row)
        a_row = tl.load(src_ptr + rm, mask=rm < M, other=-1).to(tl.int64)
        a_ok = a_row >= 0
    else:
        a_row = rm
        a_ok = rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + rk
        a = tl.load(
            x_ptr + a_row[:, None] * sxm + kk[None, :] * sxk,
            mask=a_ok[:, None] & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_base + rn[None, :] * swn + kk[:, None] * swk,
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        if PRECISION == "bf16":  # bf16 operands (x rounded to nearest even), fp32 accumulator
            acc = tl.dot(
                a.to(tl.bfloat16, fp_downcast_rounding="rtne"),
                b.to(tl.bfloat16, fp_downcast_rounding="rtne"),
                acc,
            )
        else:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision=PRECISION)
    if SCATTER:  # row r of the tile goes to out[dst[r]] (-1: not stored)
        o_row = tl.load(dst_ptr + rm, mask=rm < M, other=-1).to(tl.int64)
        o_ok = o_row >= 0
    else:
        o_row = rm
        o_ok = rm < M
    tl.store(
        out_ptr + o_row[:, None] * som + rn[None, :],
        acc,
        mask=o_ok[:, None] & (rn[None, :] < N) & live,
    )


def tiling_for(weight: torch.Tensor) -> LinearTiling:
    """``linear``'s default tiling for ``weight``: by its dtype (``BF16_LINEAR_TILING`` for
    bf16, ``LINEAR_TILING`` otherwise)."""
    return BF16_LINEAR_TILING if weight.dtype == torch.bfloat16 else LINEAR_TILING


def linear(
    x: torch.Tensor, weight: torch.Tensor, tiling: LinearTiling | None = None
) -> torch.Tensor:
    """``x[M, K] (fp32) @ weight[N, K].T`` -> fp32 ``[M, N]`` (any strides).

    The default tiling follows the weight's dtype: ``BF16_LINEAR_TILING`` for bf16 weights,
    ``LINEAR_TILING`` (``tf32x3``) otherwise. A row's bits depend on its own inputs and the
    weight, never on ``M``."""
    t = tiling or tiling_for(weight)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _linear_kernel[grid](
        x,
        weight,
        out,
        out,  # tile_expert, src, dst: unread (not GROUPED, GATHER or SCATTER)
        out,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        0,
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        **_linear_constants(t, grouped=False, gather=False, scatter=False),
    )
    return out


def _linear_constants(
    t: LinearTiling, *, grouped: bool, gather: bool, scatter: bool
) -> dict[str, object]:
    """``_linear_kernel``'s compile-time constants for tiling ``t``: one place, so ``linear``
    and ``grouped_linear`` of one tiling compile the same loop over K."""
    return {
        "BLOCK_M": t.block_m,
        "BLOCK_N": t.block_n,
        "BLOCK_K": t.block_k,
        "GROUP_M": t.group_m,
        "PRECISION": t.precision,
        "GROUPED": grouped,
        "GATHER": gather,
        "SCATTER": scatter,
        "num_warps": t.num_warps,
        "num_stages": t.num_stages,
    }


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tile_expert: torch.Tensor,
    *,
    rows: int,
    src: torch.Tensor | None = None,
    dst: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiling: LinearTiling | None = None,
) -> torch.Tensor:
    """``linear`` for rows grouped by expert in whole tiles: ``rows`` (a multiple of the
    tiling's ``block_m``) padded rows, tile ``i`` times ``weight[tile_expert[i]].T``
    (``weight[E, N, K]``; ``tile_expert`` int32 on the device, -1 for a tile past the last
    group: nothing computed, nothing written, so a new output's rows there are garbage).

    Padded row ``r`` reads ``x[src[r]]`` (``src`` int64, -1: a zero row) or, without ``src``,
    ``x[r]``; it is written to ``out[dst[r]]`` (-1: not written) or, without ``dst``, to row
    ``r`` of a new fp32 ``[rows, N]``. The kernel and constants are ``linear``'s, so a row's
    bits are the ones ``linear(x_row, weight[e])`` gives, whatever rows come with it."""
    t = tiling or tiling_for(weight)
    k = x.shape[1]
    n = weight.shape[1]
    if rows % t.block_m:
        raise ValueError(f"grouped_linear: {rows} rows are not whole tiles of {t.block_m}")
    if out is None:
        out = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    if rows == 0 or n == 0:
        return out
    grid = ((rows // t.block_m) * triton.cdiv(n, t.block_n),)
    _linear_kernel[grid](
        x,
        weight,
        out,
        tile_expert,
        x if src is None else src,
        x if dst is None else dst,
        rows,
        n,
        k,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        **_linear_constants(t, grouped=True, gather=src is not None, scatter=dst is not None),
    )
    return out


# --------------------------------------------------------------------------- row kernels


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, d_float, w_rows, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    w_row = w_ptr + (row % w_rows) * D
    o_row = out_ptr + row * D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0)
        acc += x * x
    ms = tl.div_rn(tl.sum(acc, axis=0), d_float)
    inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0)
        w = tl.load(w_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        tl.store(o_row + offs, (x * inv) * w, mask=offs < D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of contiguous rows ``x[R, D]``; row ``r`` uses ``weight[r % W]`` of ``[W, D]``."""
    rows, d = x.shape
    out = torch.empty_like(x)
    if rows:
        block = min(_ROW_BLOCK, triton.next_power_of_2(d))
        _rms_norm_kernel[(rows,)](x, weight, out, d, float(d), weight.shape[0], eps, BLOCK=block)
    return out


@triton.jit
def _rms_norm_backward_kernel(
    x_ptr, w_ptr, g_ptr, dx_ptr, dw_rows_ptr, D, d_float, w_rows, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    g_row = g_ptr + row * D
    w_row = w_ptr + (row % w_rows) * D
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    gwx = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0)
        g = tl.load(g_row + offs, mask=offs < D, other=0.0)
        w = tl.load(w_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        sq += x * x
        gwx += g * w * x
    inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / d_float + eps)
    c = tl.sum(gwx, axis=0) / d_float * inv * inv * inv
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0)
        g = tl.load(g_row + offs, mask=offs < D, other=0.0)
        w = tl.load(w_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * D + offs, inv * (g * w) - x * c, mask=offs < D)
        tl.store(dw_rows_ptr + row * D + offs, g * x * inv, mask=offs < D)


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, *, need_w: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of ``rms_norm(x, weight, eps)`` for ``grad`` (contiguous ``[R, D]``):
    ``dx = inv * g*w - x * inv**3 * mean(g*w*x)`` per row in one pass, and (``need_w``)
    ``dweight[W, D]`` as a torch sum over the rows of ``g * x * inv`` (fixed order, no
    atomics). fp32; the weight's dtype is the caller's to restore."""
    rows, d = x.shape
    dx = torch.empty_like(x)
    dw_rows = torch.empty_like(x) if need_w else dx  # unread when the weight needs none
    if rows:
        block = min(_ROW_BLOCK, triton.next_power_of_2(d))
        _rms_norm_backward_kernel[(rows,)](
            x, weight, grad, dx, dw_rows, d, float(d), weight.shape[0], eps, BLOCK=block
        )
    if not need_w:
        return dx, None
    return dx, dw_rows.reshape(-1, weight.shape[0], d).sum(0)


@triton.jit
def _rope_row(H, D, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """This program's (token, head) row of a norm/rope kernel: its index, token, head, the
    row's offsets and mask, and each offset's rotate-half partner."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    return row, row // H, row % H, offs, offs < D, partner


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, D, sxt, sxh, w_rows, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, t, h, offs, ok, partner = _rope_row(H, D, HALF, BLOCK)
    x_row = x_ptr + t * sxt + h * sxh
    y = tl.load(x_row + offs, mask=ok, other=0.0)
    yp = tl.load(x_row + partner, mask=ok, other=0.0)
    if HAS_NORM:
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(y * y, axis=0), D * 1.0) + eps))
        w_row = w_ptr + (h % w_rows) * D
        y = (y * inv) * tl.load(w_row + offs, mask=ok, other=0.0).to(tl.float32)
        yp = (yp * inv) * tl.load(w_row + partner, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * D + offs, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t * D + offs, mask=ok, other=0.0)
    rotated = tl.where(offs < HALF, -yp, yp)
    tl.store(out_ptr + row * D + offs, y * c + rotated * s, mask=ok)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)`` (no norm where ``weight`` is None) for
    ``x[T, heads, D]`` (last dim contiguous; ``weight`` ``[D]`` or one row per head
    ``[heads, D]``; ``cos``/``sin`` contiguous fp32 ``[T, D]``) -> contiguous fp32 ``[T, heads,
    D]``. One program per (token, head) row; its bits depend on that row alone."""
    t, heads, d = x.shape
    out = torch.empty((t, heads, d), dtype=torch.float32, device=x.device)
    if t and heads:
        w = x if weight is None else weight.reshape(-1, d)
        _norm_rope_kernel[(t * heads,)](
            x, w, cos, sin, out, heads, d, x.stride(0), x.stride(1), w.shape[0], eps,
            HAS_NORM=weight is not None, HALF=d // 2, BLOCK=triton.next_power_of_2(d),
        )  # fmt: skip
    return out


@triton.jit
def _norm_rope_backward_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, g_ptr, dx_ptr, dw_rows_ptr, H, D, sxt, sxh, w_rows, eps,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, t, h, offs, ok, partner = _rope_row(H, D, HALF, BLOCK)
    g = tl.load(g_ptr + row * D + offs, mask=ok, other=0.0)
    gp = tl.load(g_ptr + row * D + partner, mask=ok, other=0.0)
    c = tl.load(cos_ptr + t * D + offs, mask=ok, other=0.0)
    sp = tl.load(sin_ptr + t * D + partner, mask=ok, other=0.0)
    # out[j] = y[j] cos[j] -/+ y[p(j)] sin[j] (minus for j < HALF): so y[i] gets
    # g[i] cos[i] and, through out[p(i)], +g[p(i)] sin[p(i)] for i < HALF, minus above
    dy = g * c + tl.where(offs < HALF, gp * sp, -(gp * sp))
    if HAS_NORM:
        x = tl.load(x_ptr + t * sxt + h * sxh + offs, mask=ok, other=0.0)
        w = tl.load(w_ptr + (h % w_rows) * D + offs, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        gw = dy * w
        cc = tl.sum(gw * x, axis=0) / D * inv * inv * inv
        tl.store(dx_ptr + row * D + offs, inv * gw - x * cc, mask=ok)
        tl.store(dw_rows_ptr + row * D + offs, dy * x * inv, mask=ok)
    else:
        tl.store(dx_ptr + row * D + offs, dy, mask=ok)


def norm_rope_backward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    grad: torch.Tensor,
    eps: float,
    *,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients ``(dx [T, heads, D], dweight)`` of ``norm_rope`` for a contiguous ``grad``;
    ``dweight`` (fp32, ``weight``'s shape) as a torch sum over the rows (no atomics), only with
    ``need_w`` and a weight."""
    t, heads, d = x.shape
    dx = torch.empty((t, heads, d), dtype=torch.float32, device=x.device)
    with_w = need_w and weight is not None
    dw_rows = torch.empty_like(dx) if with_w else dx  # unread without a weight gradient
    if t and heads:
        w = x if weight is None else weight.reshape(-1, d)
        _norm_rope_backward_kernel[(t * heads,)](
            x, w, cos, sin, grad, dx, dw_rows, heads, d, x.stride(0), x.stride(1), w.shape[0],
            eps, HAS_NORM=weight is not None, HALF=d // 2, BLOCK=triton.next_power_of_2(d),
        )  # fmt: skip
    if not with_w:
        return dx, None
    assert weight is not None
    w_rows = weight.reshape(-1, d).shape[0]
    if w_rows == 1:
        return dx, dw_rows.reshape(-1, d).sum(0).reshape(weight.shape)
    return dx, dw_rows.sum(0).reshape(weight.shape)


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, N, LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    o_row = out_ptr + row * N
    top = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(x_row + offs, mask=offs < N, other=float("-inf")))
    mx = tl.max(top, axis=0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < N, other=float("-inf"))
        acc += tl.where(offs < N, tl.exp(x - mx), 0.0)
    total = tl.sum(acc, axis=0)
    log_total = tl.log(total)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < N, other=0.0)
        if LOG:  # noqa: SIM108  (a constexpr branch)
            y = (x - mx) - log_total
        else:
            y = tl.div_rn(tl.exp(x - mx), total)
        tl.store(o_row + offs, y, mask=offs < N)


def softmax(x: torch.Tensor, *, log: bool) -> torch.Tensor:
    """(Log-)softmax over the last dim of contiguous rows ``x[R, N]``."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows and n:
        block = min(_ROW_BLOCK, triton.next_power_of_2(n))
        _softmax_kernel[(rows,)](x, out, n, LOG=log, BLOCK=block)
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, C, sg, su, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    g = tl.load(g_ptr + row * sg + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * su + offs, mask=mask, other=0.0)
    y = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * C + offs, y, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate / (1 + exp(-gate)) * up`` for ``[R, C]`` (rows may be strided, columns dense)."""
    rows, c = gate.shape
    out = torch.empty((rows, c), dtype=torch.float32, device=gate.device)
    if rows and c:
        grid = (rows, triton.cdiv(c, _EW_BLOCK))
        _silu_mul_kernel[grid](gate, up, out, c, gate.stride(0), up.stride(0), BLOCK=_EW_BLOCK)
    return out


@triton.jit
def _silu_mul_backward_kernel(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, C, sg, su, sd, sdg, sdu,
                              BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    g = tl.load(g_ptr + row * sg + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * su + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * sd + offs, mask=mask, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(dg_ptr + row * sdg + offs, d * u * s * (1.0 + g * (1.0 - s)), mask=mask)
    tl.store(du_ptr + row * sdu + offs, d * g * s, mask=mask)


def silu_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor, d_gate: torch.Tensor,
    d_up: torch.Tensor,
) -> None:  # fmt: skip
    """The gradients of ``silu(gate) * up`` for ``grad``, written into ``d_gate`` and ``d_up``
    (all ``[R, C]`` fp32, rows may be strided, columns dense; ``d_gate``/``d_up`` may be the
    two halves of one ``[R, 2C]`` buffer): ``dgate = grad * up * s * (1 + gate * (1 - s))``,
    ``dup = grad * gate * s`` for ``s = sigmoid(gate)``, in one pass."""
    rows, c = gate.shape
    if rows and c:
        grid = (rows, triton.cdiv(c, _EW_BLOCK))
        _silu_mul_backward_kernel[grid](
            gate, up, grad, d_gate, d_up, c, gate.stride(0), up.stride(0), grad.stride(0),
            d_gate.stride(0), d_up.stride(0), BLOCK=_EW_BLOCK,
        )  # fmt: skip


# --------------------------------------------------------------------------- attention


@triton.jit(do_not_specialize=["T"])
def _row_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    kstart_ptr,
    pos_ptr,
    T,
    HD,
    sqt,
    sqh,
    skt,
    skh,
    svt,
    svh,
    sot,
    soh,
    scale,
    window,
    GROUP: tl.constexpr,
    TOK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HD_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t0 = tl.program_id(0)
    kvh = tl.program_id(1)
    ks0 = tl.load(kstart_ptr + t0)
    p0 = tl.load(pos_ptr + t0)
    # A tile is a run of <= TOK consecutive tokens of one key row with consecutive positions,
    # not crossing a multiple of TOK; token t0 leads one iff it does not continue t0 - 1's.
    prev = tl.maximum(t0 - 1, 0)
    continues = (
        (t0 > 0)
        & (tl.load(kstart_ptr + prev) == ks0)
        & (tl.load(pos_ptr + prev) == p0 - 1)
        & (p0 % TOK != 0)
    )
    j = tl.arange(0, TOK)
    tj = t0 + j
    inside = tj < T
    ksj = tl.load(kstart_ptr + tj, mask=inside, other=-1)
    pj = tl.load(pos_ptr + tj, mask=inside, other=-1)
    breaks = (~inside) | (ksj != ks0) | (pj != p0 + j) | ((p0 % TOK) + j >= TOK)
    n_tok = tl.min(tl.where(breaks, j, TOK), axis=0)
    n_tok = tl.where(continues, 0, n_tok)

    r = tl.arange(0, BLOCK_M)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = tok < n_tok
    qpos = p0 + tok
    d = tl.arange(0, HD_PAD)
    d_ok = d < HD
    q = tl.load(
        q_ptr + (t0 + tok).to(tl.int64)[:, None] * sqt + head[:, None] * sqh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if PRECISION == "bf16":
        q = q.to(tl.bfloat16, fp_downcast_rounding="rtne")
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(p0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    # One past the last slot any row of the tile may see. A program that leads no tile
    # (n_tok == 0: its token continues the previous one's tile) runs no block at all: it
    # would store nothing, and before this it swept every key block up to its position
    # (TOK-fold redundant work; 77 % of the ~1B strict forward on the H200).
    hi = tl.where(n_tok > 0, p0 + n_tok, lo)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD_PAD], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        slot = (ks0 + cols).to(tl.int64)
        k_t = tl.load(
            k_ptr + slot[None, :] * skt + kvh * skh + d[:, None],
            mask=col_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if PRECISION == "bf16":
            s = tl.dot(q, k_t.to(tl.bfloat16, fp_downcast_rounding="rtne")) * scale
        else:
            s = tl.dot(q, k_t, input_precision=PRECISION) * scale
        seen = (cols[None, :] <= qpos[:, None]) & row_ok[:, None]
        if HAS_WINDOW:
            seen = seen & (qpos[:, None] - cols[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * svt + kvh * svh + d[None, :],
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if PRECISION == "bf16":
            acc = tl.dot(
                p.to(tl.bfloat16, fp_downcast_rounding="rtne"),
                v.to(tl.bfloat16, fp_downcast_rounding="rtne"),
                acc * alpha[:, None],
            )
        else:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = tl.div_rn(acc, tl.where(row_ok, l_i, 1.0)[:, None])
    tl.store(
        out_ptr + (t0 + tok).to(tl.int64)[:, None] * sot + head[:, None] * soh + d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )


def row_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kstart: torch.Tensor,
    pos: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    tiling: AttentionTiling | None = None,
) -> torch.Tensor:
    """Causal attention of ``q[T, heads, hd]`` over key rows of ``keys/values[S, kv_heads, hd]``.

    Query ``t`` (position ``pos[t]``) sees slots ``c <= pos[t]`` (and ``pos[t] - c < window``)
    of the row starting at ``keys[kstart[t]]``: slot ``c`` is ``keys[kstart[t] + c]``. Packed
    training passes the tokens themselves (``kstart = t - pos``); decode passes the cache
    flattened to ``[R * C, ...]`` (``kstart = row * C``). The last dim must be contiguous.
    Returns fp32 ``[T, heads, hd]``.
    """
    t = tiling or ATTENTION_TILING
    n_tok, heads, hd = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    block_m = max(t.block_m, triton.next_power_of_2(group))
    tokens_per_tile = 1 << ((block_m // group).bit_length() - 1)  # a power of two
    hd_pad = max(16, triton.next_power_of_2(hd))
    block_n, stages = t.block_n, t.num_stages
    if hd_pad > 128 and tiling is None:
        # Head dims above 128 (MLA's 192 = 128 nope + 64 rope) pad to 256: the default tiles
        # need 384 KiB of shared memory (an H100/H200 SM has 227 KiB). Half the key block and
        # one stage fit. It depends on the head dim only, so train and decode still share it.
        block_n, stages = 32, 1
    out = torch.empty((n_tok, heads, hd), dtype=torch.float32, device=q.device)
    if n_tok == 0:
        return out
    grid = (n_tok, kv_heads)
    _row_attention_kernel[grid](
        q,
        keys,
        values,
        out,
        kstart.to(torch.int32).contiguous(),
        pos.to(torch.int32).contiguous(),
        n_tok,
        hd,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        window if window is not None else 0,
        GROUP=group,
        TOK=tokens_per_tile,
        HAS_WINDOW=window is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HD_PAD=hd_pad,
        PRECISION=t.precision if t.precision != "auto" else ("ieee" if hd <= 64 else "tf32x3"),
        num_warps=t.num_warps,
        num_stages=stages,
    )
    return out
