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
from typing import Any, ClassVar

import torch
from torch import Tensor

from posttrain.models import _triton_kernels as kernels
from posttrain.models._ops import StrictOps
from posttrain.models._row_attention import RowAttention


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
        rows, d = x.shape
        w_rows = weight.shape[0]
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
        w = weight.float().repeat(rows // w_rows, 1)
        g = grad * w
        dx = inv * g - x * (inv**3) * (g * x).sum(-1, keepdim=True) / d
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (grad * x * inv).reshape(-1, w_rows, d).sum(0).to(weight.dtype)
        return dx, dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return kernels.silu_mul(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        d_gate = grad * up * s * (1.0 + gate * (1.0 - s))
        return d_gate, grad * gate * s


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
                q, keys, values, kstart, pos, scale, window, run, dtype
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
