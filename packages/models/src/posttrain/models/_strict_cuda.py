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

from typing import Any, ClassVar

import torch
from torch import Tensor

from posttrain.models import _triton_kernels as kernels
from posttrain.models._ops import StrictOps

# Elements of the [n, heads, L] score tensor per chunk in attention's backward (memory only).
_BACKWARD_CHUNK = 1 << 26


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


class _RowAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        kstart: Tensor,
        pos: Tensor,
        scale: float,
        window: int | None,
        tiling: kernels.AttentionTiling,
    ) -> Tensor:
        out = kernels.row_attention(
            q, keys, values, kstart, pos, scale=scale, window=window, tiling=tiling
        )
        ctx.save_for_backward(q, keys, values, kstart, pos, out)
        ctx.scale, ctx.window = scale, window
        ctx.dtype = torch.bfloat16 if tiling.precision == "bf16" else torch.float32
        return out

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None, None, None]:
        q, keys, values, kstart, pos, out = ctx.saved_tensors
        dq, dk, dv = _row_attention_backward(
            q, keys, values, kstart, pos, out, grad, ctx.scale, ctx.window, ctx.dtype
        )
        return dq, dk, dv, None, None, None, None, None


def _row_attention_backward(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    kstart: Tensor,
    pos: Tensor,
    out: Tensor,
    grad: Tensor,
    scale: float,
    window: int | None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute each key row's probabilities in torch and form the three gradients: the
    matmuls take ``dtype`` operands (bf16 where the forward's dots did) into fp32 results,
    the softmax and its gradient are fp32.

    Queries are grouped into runs of consecutive tokens with the same key row (``kstart``: a
    packed segment is one run); the runs, their ends and key lengths reach the host in one
    transfer per call (not one sync per segment). Runs are processed in order and write
    ``dk``/``dv`` slices of their own key row: deterministic, no atomics.
    """
    packed = _packed_runs(q, keys, kstart, pos)
    if packed is not None:
        return _packed_attention_backward(
            q, keys, values, pos, out, grad, scale, window, dtype, *packed
        )
    _, heads, hd = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    dq = torch.zeros_like(q)
    dk = torch.zeros(keys.shape, dtype=torch.float32, device=keys.device)
    dv = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    starts, counts = torch.unique_consecutive(kstart, return_counts=True)
    run = torch.repeat_interleave(torch.arange(counts.numel(), device=pos.device), counts)
    longest = torch.zeros_like(starts).scatter_reduce(0, run, pos.to(starts.dtype), "amax")
    table = torch.stack([starts, counts.cumsum(0), longest + 1]).tolist()  # one sync
    begin = 0
    for start, end, length in zip(*table, strict=True):
        kk, vv = keys[start : start + length].to(dtype), values[start : start + length].to(dtype)
        slots = torch.arange(length, device=q.device)
        step = max(1, _BACKWARD_CHUNK // (heads * length))
        for i in range(begin, end, step):
            idx = slice(i, min(i + step, end))
            n = idx.stop - i
            qq = q[idx].reshape(n, kv_heads, group, hd).to(dtype)
            do_full = grad[idx].reshape(n, kv_heads, group, hd)
            do = do_full.to(dtype)
            oo = out[idx].reshape(n, kv_heads, group, hd)
            dist = pos[idx][:, None] - slots[None, :]
            seen = dist >= 0
            if window is not None:
                seen = seen & (dist < window)
            scores = torch.einsum("nkgd,lkd->nkgl", qq, kk).float() * scale
            scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            dv[start : start + length] += torch.einsum("nkgl,nkgd->lkd", probs.to(dtype), do)
            dp = torch.einsum("nkgd,lkd->nkgl", do, vv).float()
            ds = probs * (dp - (do_full * oo).sum(-1, keepdim=True)) * scale
            ds_low = ds.to(dtype)
            dq[idx] = torch.einsum("nkgl,lkd->nkgd", ds_low, kk).reshape(n, heads, hd)
            dk[start : start + length] += torch.einsum("nkgl,nkgd->lkd", ds_low, qq)
        begin = end
    return dq, dk.to(keys.dtype), dv.to(values.dtype)


def _packed_runs(
    q: Tensor, keys: Tensor, kstart: Tensor, pos: Tensor
) -> tuple[Tensor, int, int] | None:
    """For the packed training layout -- every token's keys are its own segment's tokens, in
    order (``kstart = t - pos``, ``keys`` the tokens themselves) -- each token's segment
    index, the number of segments and the longest one (one host transfer); else None."""
    t = q.shape[0]
    if keys.shape[0] != t or t == 0:
        return None
    token = torch.arange(t, device=pos.device)
    first = pos == 0
    steps = (pos[1:] == pos[:-1] + 1) | first[1:]  # positions count up from 0 per segment
    facts = torch.stack(
        [
            ((kstart.to(token.dtype) == token - pos).all() & steps.all()).to(token.dtype),
            first[0].to(token.dtype),
            first.sum(),
            pos.max() + 1,
        ]
    ).tolist()  # one sync
    if not (facts[0] and facts[1]):
        return None
    seg = torch.cumsum(first.to(token.dtype), 0) - 1
    return seg, int(facts[2]), int(facts[3])


def _packed_attention_backward(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    out: Tensor,
    grad: Tensor,
    scale: float,
    window: int | None,
    dtype: torch.dtype,
    seg: Tensor,
    segments: int,
    longest: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``_row_attention_backward`` for the packed training layout in a few batched ops: the
    segments padded at their ends to the longest (a query never sees a pad key: the pads come
    after it; pad rows get no gradient and are dropped), in groups of segments that keep the
    ``[segments, kv_heads, group, L, L]`` scores under ``_BACKWARD_CHUNK`` elements. Same
    math, same precision rule (``dtype`` operands, fp32 softmax), no per-segment loop."""
    t, heads, hd = q.shape
    kv_heads, hd_v = keys.shape[1], values.shape[2]
    group = heads // kv_heads
    length = longest
    slot = None if segments * length == t else seg * length + pos  # row in the padded batch

    def padded(x: Tensor) -> Tensor:  # [T, ...] -> [S, L, ...]
        rows = x if slot is None else x.new_zeros((segments * length, *x.shape[1:]))
        if slot is not None:
            rows = rows.index_copy(0, slot, x)
        return rows.reshape(segments, length, *x.shape[1:])

    def unpadded(x: Tensor) -> Tensor:  # [S, L, ...] -> [T, ...]
        rows = x.reshape(segments * length, *x.shape[2:])
        return rows if slot is None else rows[slot]

    qp = padded(q).reshape(segments, length, kv_heads, group, hd)
    kp, vp = padded(keys), padded(values)
    gp = padded(grad).reshape(segments, length, kv_heads, group, hd_v)
    op = padded(out).reshape(segments, length, kv_heads, group, hd_v)
    slots = torch.arange(length, device=q.device)
    dist = slots[:, None] - slots[None, :]  # query position - key position
    seen = dist >= 0 if window is None else (dist >= 0) & (dist < window)
    hidden = ~seen
    dq = torch.empty((segments, length, kv_heads, group, hd), dtype=torch.float32, device=q.device)
    dk = torch.empty((segments, length, kv_heads, hd), dtype=torch.float32, device=q.device)
    dv = torch.empty((segments, length, kv_heads, hd_v), dtype=torch.float32, device=q.device)
    step = max(1, _BACKWARD_CHUNK // (heads * length * length))
    for s0 in range(0, segments, step):
        part = slice(s0, min(s0 + step, segments))
        qq, kk, vv = qp[part].to(dtype), kp[part].to(dtype), vp[part].to(dtype)
        do_full, oo = gp[part], op[part]
        do = do_full.to(dtype)
        scores = torch.einsum("sqkgd,slkd->skgql", qq, kk).float() * scale
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        dv[part] = torch.einsum("skgql,sqkgd->slkd", probs.to(dtype), do)
        dp = torch.einsum("sqkgd,slkd->skgql", do, vv).float()
        rowdot = (do_full * oo).sum(-1).permute(0, 2, 3, 1)[..., None]  # [s, k, g, q, 1]
        ds = (probs * (dp - rowdot) * scale).to(dtype)
        dq[part] = torch.einsum("skgql,slkd->sqkgd", ds, kk)
        dk[part] = torch.einsum("skgql,sqkgd->slkd", ds, qq)
    return (
        unpadded(dq).reshape(t, heads, hd).to(q.dtype),
        unpadded(dk).to(keys.dtype),
        unpadded(dv).to(values.dtype),
    )


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

    fused_row_attention = True
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
            out: Tensor = _RowAttention.apply(q, keys, values, kstart, pos, scale, window, tiling)
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
