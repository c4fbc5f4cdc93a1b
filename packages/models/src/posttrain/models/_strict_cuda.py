# mypy: disable-error-code="no-untyped-call"
"""``CudaStrictOps``: the strict kernel set on CUDA, batch-invariant Triton kernels with backward.

``DecoderModel.ops`` picks it when numerics is strict and the model is on CUDA (or when a test
asks for it under Triton's interpreter). It keeps ``StrictOps``' contract -- a token's bits
depend on the token's own inputs only, so the packed training forward, prefill and decode
agree bit for bit -- with kernels that run near the speed of the fast path (see
``_triton_kernels`` for how each one keeps a fixed reduction per output row).

What it overrides: ``linear`` (also the MoE expert matmuls and LoRA factors), ``rms_norm``,
``silu_mul``, ``softmax``, ``log_softmax`` and attention over key rows (``attend_rows``, used
by ``_blocks`` for the packed forward and for decode). It inherits from ``StrictOps`` the
elementwise and tiny fixed-tree ops (``sigmoid``, ``sconv``, ``moe_combine``, ``sum_last``)
and ``attention``, which ``_blocks`` still uses for layers with a relative position bias (on
both paths, so those layers keep train == decode too).

Backward passes are ordinary torch (cuBLAS matmuls: fp32 without TF32 unless the caller
enables it; bf16 operands in ``CudaStrictBf16Ops``; no atomics): deterministic run to run, not
batch invariant, which training does not need.

Bits: CUDA strict differs from CPU strict (``StrictOps``: ``tree_sum`` and ``exp_strict``);
both are references of their own device.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar

import torch
from torch import Tensor

from posttrain.models import _triton_kernels as kernels
from posttrain.models._expert_rows import (
    ExpertRows,
    expert_rows,
    pair_rows,
    source_rows,
    tile_experts,
)
from posttrain.models._ops import StrictOps
from posttrain.models._row_attention import PackedRuns, RowAttention


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return kernels.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        if weight.dtype == torch.bfloat16:  # bf16 operands, as the forward's dot (and fast bf16)
            g = grad.to(torch.bfloat16)
            dx = (g @ weight).float() if ctx.needs_input_grad[0] else None
            dw = g.t() @ x.to(torch.bfloat16) if ctx.needs_input_grad[1] else None
            return dx, dw
        dx = grad @ weight.float() if ctx.needs_input_grad[0] else None
        dw = (grad.t() @ x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernels.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        need_w = bool(ctx.needs_input_grad[1])
        dx, dw = kernels.rms_norm_backward(x, weight, _dense_rows(grad), ctx.eps, need_w=need_w)
        return dx, (None if dw is None else dw.to(weight.dtype)), None


def _dense_rows(x: Tensor) -> Tensor:
    """``x`` with a contiguous last dim (autograd's gradients nearly always are)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return kernels.silu_mul(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(grad), torch.empty_like(grad)
        kernels.silu_mul_backward(gate, up, _dense_rows(grad), d_gate, d_up)
        return d_gate, d_up


class _SiluMulHalves(torch.autograd.Function):
    """``silu_mul`` of the halves of one ``[R, 2C]`` tensor with its gradient as one ``[R, 2C]``
    tensor (two slices' gradients would each be a zero-filled ``[R, 2C]``, then added)."""

    @staticmethod
    def forward(ctx: Any, gu: Tensor) -> Tensor:
        ctx.save_for_backward(gu)
        c = gu.shape[1] // 2
        return kernels.silu_mul(gu[:, :c], gu[:, c:])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (gu,) = ctx.saved_tensors
        c = gu.shape[1] // 2
        d_gu = torch.empty(gu.shape, dtype=torch.float32, device=gu.device)
        kernels.silu_mul_backward(gu[:, :c], gu[:, c:], _dense_rows(grad), d_gu[:, :c], d_gu[:, c:])
        return d_gu


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, log: bool) -> Tensor:
        out = kernels.softmax(x, log=log)
        ctx.save_for_backward(out)
        ctx.log = log
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        if ctx.log:
            return grad - out.exp() * grad.sum(-1, keepdim=True), None
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor
    ) -> Tensor:
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps = eps
        return kernels.norm_rope(x, weight, cos, sin, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, cos, sin = ctx.saved_tensors
        need_w = bool(ctx.needs_input_grad[1])
        dx, dw = kernels.norm_rope_backward(
            x, weight, cos, sin, grad.contiguous(), ctx.eps, need_w=need_w
        )
        if dw is not None and weight is not None:
            dw = dw.to(weight.dtype)
        return dx, dw, None, None, None


def _needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd must record this op (else the kernel is called directly: decode
    skips the ``Function`` bookkeeping; the bits are the same kernel's either way)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _row_softmax(x: Tensor, *, log: bool) -> Tensor:
    """(Log-)softmax over the last dim, one kernel program per row; autograd when recording."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    if _needs_grad(x2):
        out: Tensor = _Softmax.apply(x2, log)
    else:
        out = kernels.softmax(x2, log=log)
    return out.reshape(x.shape)


def _experts_forward(
    m: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor, tiling: kernels.LinearTiling
) -> tuple[Tensor, ExpertRows, Tensor, Tensor]:
    """``[T, k, H]`` routed outputs of ``m[T, H]`` (fp32), and what the backward reads: the
    padded layout, ``gate_up`` and ``act`` over the padded rows. Rows are
    gathered from ``m`` and scattered to the output inside the GEMMs (no padded copy of
    ``m``); pad rows are zeros all the way (``silu_mul(0, 0) = 0``), the tiles past the last
    group too (never computed: ``gate_up`` starts as zeros)."""
    t, k = ids.shape
    align = tiling.block_m
    layout = expert_rows(ids, fc1.shape[0], align)
    tiles = tile_experts(layout, align)
    x = _dense_rows(m.float())
    # zeros past the last group (its tiles are never written): no garbage in any row
    gate_up = torch.zeros((layout.rows, fc1.shape[1]), dtype=torch.float32, device=m.device)
    kernels.grouped_linear(
        x, fc1, tiles, rows=layout.rows, src=source_rows(layout, k), out=gate_up, tiling=tiling
    )
    inter = fc2.shape[2]
    act = kernels.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
    out = torch.empty((t * k, fc2.shape[1]), dtype=torch.float32, device=m.device)
    kernels.grouped_linear(
        act, fc2, tiles, rows=layout.rows, dst=pair_rows(layout), out=out, tiling=tiling
    )
    return out.reshape(t, k, -1), layout, gate_up, act


class _RoutedExperts(torch.autograd.Function):
    """``CudaStrictOps.routed_experts`` with a backward over the same padded groups: the four
    matmuls per expert as ``torch._grouped_mm`` (bf16 weights: bf16 operands, as ``_Linear``'s
    backward; no host sync) or expert by expert (fp32, or where ``_grouped_mm`` is missing),
    SiLU's gradient in one kernel, and each token's input gradient the sum of its ``k`` slots
    in slot order (deterministic, no atomics)."""

    @staticmethod
    def forward(
        ctx: Any, m: Tensor, fc1: Tensor, fc2: Tensor, ids: Tensor, tiling: kernels.LinearTiling
    ) -> Tensor:
        out, layout, gate_up, act = _experts_forward(m, ids, fc1, fc2, tiling)
        ctx.save_for_backward(m, fc1, fc2, layout.row_of_pair, layout.ends, gate_up, act)
        ctx.rows = layout.rows
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        m, fc1, fc2, row_of_pair, ends, gate_up, act = ctx.saved_tensors
        need_m, need_fc1, need_fc2 = ctx.needs_input_grad[:3]
        t, k, h = grad.shape
        inter = fc2.shape[2]
        dt = torch.bfloat16 if fc1.dtype == torch.bfloat16 else torch.float32
        # the groups end at ends[-1]: the zero rows past it are in no group
        mm = _GroupedMatmul(ends, dt)
        dy = grad.new_zeros((ctx.rows, h), dtype=dt).index_copy_(
            0, row_of_pair, grad.reshape(t * k, h).to(dt)
        )
        d_fc2 = mm.outer(dy, act).to(fc2.dtype) if need_fc2 else None
        if not (need_m or need_fc1):
            return None, None, d_fc2, None, None
        d_act = mm.rows(dy, fc2)
        d_gu = torch.empty_like(gate_up)
        kernels.silu_mul_backward(
            gate_up[:, :inter], gate_up[:, inter:], d_act, d_gu[:, :inter], d_gu[:, inter:]
        )
        d_gu_low = d_gu.to(dt)
        d_fc1 = d_m = None
        if need_fc1:
            xp = m.new_zeros((ctx.rows, h), dtype=dt).index_copy_(
                0, row_of_pair, m.to(dt).repeat_interleave(k, dim=0)
            )
            d_fc1 = mm.outer(d_gu_low, xp).to(fc1.dtype)
        if need_m:
            d_pairs = mm.rows(d_gu_low, fc1)[row_of_pair].reshape(t, k, h)
            d_m = d_pairs[:, 0]
            for j in range(1, k):
                d_m = d_m + d_pairs[:, j]
        return d_m, d_fc1, d_fc2, None, None


_GROUPED_MM_FAILED: list[str] = []
"""The error of a failed ``torch._grouped_mm`` call in ``_GroupedMatmul``, if one failed."""


class _GroupedMatmul:
    """The routed experts' backward matmuls over padded groups (``offs``: each group's end
    row): ``torch._grouped_mm`` for bf16 operands where torch has it, else one matmul per
    group (the group ends reach the host once)."""

    def __init__(self, offs: Tensor, dtype: torch.dtype) -> None:
        self.offs, self.offs32, self.dtype = offs, offs.to(torch.int32), dtype
        self.grouped = (
            dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and not _GROUPED_MM_FAILED
        )
        self._ends: list[int] | None = None

    def _give_up(self, err: RuntimeError) -> None:
        """Stop using ``torch._grouped_mm`` here and in this process (warned once)."""
        if not _GROUPED_MM_FAILED:
            warnings.warn(
                f"torch._grouped_mm failed ({err}); the strict routed experts' backward runs "
                "one matmul per expert",
                RuntimeWarning,
                stacklevel=3,
            )
        _GROUPED_MM_FAILED.append(str(err))
        self.grouped = False

    def _bounds(self) -> list[tuple[int, int]]:
        if self._ends is None:
            self._ends = self.offs.tolist()
        starts = [0, *self._ends[:-1]]
        return list(zip(starts, self._ends, strict=True))

    def rows(self, a: Tensor, w: Tensor) -> Tensor:
        """fp32 ``[rows, N]``: group ``e``'s rows of ``a[rows, K]`` times ``w[e]`` (``[K, N]``)."""
        wt = w.to(self.dtype)
        if self.grouped:
            try:
                return torch._grouped_mm(a, wt, offs=self.offs32).float()
            except RuntimeError as err:  # a build or device without the kernel: the loop
                self._give_up(err)
        out = torch.empty((a.shape[0], w.shape[2]), dtype=torch.float32, device=a.device)
        for e, (lo, hi) in enumerate(self._bounds()):
            out[lo:hi] = (a[lo:hi] @ wt[e]).float()
        return out

    def outer(self, a: Tensor, b: Tensor) -> Tensor:
        """``[E, A, B]``: ``a[rows, A]^T @ b[rows, B]`` over each group's rows."""
        bt = b.to(self.dtype)
        if self.grouped:
            try:
                return torch._grouped_mm(a.t(), bt, offs=self.offs32)
            except RuntimeError as err:
                self._give_up(err)
        return torch.stack([a[lo:hi].t() @ bt[lo:hi] for lo, hi in self._bounds()])


class CudaStrictOps(StrictOps):
    """Strict numerics on CUDA through batch-invariant Triton kernels (see the module doc)."""

    @classmethod
    def uses_row_attention(cls, q: Tensor) -> bool:
        """Always: the Triton kernel serves training and decode."""
        return True

    attention_tiling: ClassVar[kernels.AttentionTiling] = kernels.ATTENTION_TILING
    """``row_attention``'s tiling (its dots' precision): one per kernel set, so training and
    decode of one model share it."""

    @staticmethod
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` in fp32 by the one-tiling Triton GEMM (row-invariant)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float()  # activations are fp32 (a no-op then)
        if _needs_grad(x2, weight):
            out: Tensor = _Linear.apply(x2, weight)
        else:
            out = kernels.linear(x2, weight)
        return out.reshape(*lead, weight.shape[0])

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """Per-row RMSNorm; ``weight`` is ``[D]`` or one row per head ``[heads, D]``."""
        d = x.shape[-1]
        x2, w2 = x.reshape(-1, d).float().contiguous(), weight.reshape(-1, d)
        if _needs_grad(x2, w2):
            out: Tensor = _RmsNorm.apply(x2, w2, eps)
        else:
            out = kernels.rms_norm(x2, w2, eps)
        return out.reshape(x.shape)

    @staticmethod
    def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
        """``gate / (1 + exp(-gate)) * up`` (elementwise kernel)."""
        lead = gate.shape[:-1]
        c = gate.shape[-1]
        g2, u2 = gate.reshape(-1, c), up.reshape(-1, c)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
        if u2.stride(-1) != 1:
            u2 = u2.contiguous()
        if _needs_grad(g2, u2):
            out: Tensor = _SiluMul.apply(g2, u2)
        else:
            out = kernels.silu_mul(g2, u2)
        return out.reshape(*lead, c)

    @classmethod
    def silu_mul_halves(cls, gu: Tensor) -> Tensor:
        """``silu_mul`` of ``gu[..., :C]`` and ``gu[..., C:]`` (one kernel; one gradient)."""
        lead, c2 = gu.shape[:-1], gu.shape[-1]
        g2 = _dense_rows(gu.reshape(-1, c2))
        if _needs_grad(g2):
            out: Tensor = _SiluMulHalves.apply(g2)
        else:
            out = kernels.silu_mul(g2[:, : c2 // 2], g2[:, c2 // 2 :])
        return out.reshape(*lead, c2 // 2)

    @classmethod
    def norm_rope(
        cls, x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """``FastOps.norm_rope`` as one kernel per (token, head) row (and one backward)."""
        x = _dense_rows(x.float())
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        if _needs_grad(x, *(() if weight is None else (weight,))):
            out: Tensor = _NormRope.apply(x, weight, eps, cos, sin)
            return out
        return kernels.norm_rope(x, weight, cos, sin, eps)

    @classmethod
    def routed_experts(cls, m: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor | None:
        """A MoE layer's routed experts in a few launches and no host sync (``_experts``):
        ``grouped_linear`` of ``fc1``, ``silu_mul``, ``grouped_linear`` of ``fc2`` over the
        pairs grouped by expert; every row the bits ``linear``/``silu_mul`` give it alone, as
        the expert-by-expert loop computes. Under autograd ``_RoutedExperts``' backward."""
        tiling = kernels.tiling_for(fc1)
        if _needs_grad(m, fc1, fc2):
            out: Tensor = _RoutedExperts.apply(m, fc1, fc2, ids, tiling)
            return out
        return _experts_forward(m, ids, fc1, fc2, tiling)[0]

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        """Per-row log-softmax (fixed block loop)."""
        return _row_softmax(x, log=True)

    @staticmethod
    def softmax(x: Tensor) -> Tensor:
        """Per-row softmax (fixed block loop)."""
        return _row_softmax(x, log=False)

    @classmethod
    def attend_rows(
        cls,
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        kstart: Tensor,
        pos: Tensor,
        *,
        scale: float,
        window: int | None,
        runs: PackedRuns | None = None,
    ) -> Tensor:
        """See ``FastOps.attend_rows``: one Triton kernel for training and decode."""
        if keys.stride(-1) != 1:
            keys = keys.contiguous()
        if values.stride(-1) != 1:
            values = values.contiguous()
        if q.stride(-1) != 1:
            q = q.contiguous()
        tiling = cls.attention_tiling
        if _needs_grad(q, keys, values):
            run = functools.partial(
                kernels.row_attention, scale=scale, window=window, tiling=tiling
            )
            dtype = torch.bfloat16 if tiling.precision == "bf16" else torch.float32
            out: Tensor = RowAttention.apply(
                q, keys, values, kstart, pos, scale, window, run, dtype, None, runs
            )
        else:
            out = kernels.row_attention(
                q, keys, values, kstart, pos, scale=scale, window=window, tiling=tiling
            )
        return out.reshape(q.shape[0], -1)


class CudaStrictBf16Ops(CudaStrictOps):
    """``CudaStrictOps`` for a model whose weights are bf16 (a bf16 checkpoint served, or
    FSDP's bf16 compute copy under ``precision="bf16"``): linears make one bf16 tensor-core
    pass (``linear`` picks ``BF16_LINEAR_TILING`` from the weight's dtype) and attention's two
    dots take bf16 operands, all into fp32 accumulators; norms, softmaxes, the residual stream
    and the logits stay fp32. Backwards run their matmuls in bf16. Same contract: a token's
    bits depend on its own inputs only, so training and decode of the model agree bit for bit.
    """

    attention_tiling = kernels.BF16_ATTENTION_TILING
