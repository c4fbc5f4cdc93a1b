"""The two kernel sets behind one model: ``FastOps`` (ordinary torch) and ``StrictOps``.

Strict kernels make a token's result independent of everything but the token's own
inputs: batch size, packing, padding, prefill versus decode, and thread count. They get
there with two rules, both cheaper to state than to prove for library kernels:

1. **Every reduction has a fixed shape and a fixed order.** A dot product over ``K`` is an
   elementwise product followed by a pairwise tree of elementwise adds over ``K`` padded
   to a power of two (``tree_sum``). Elementwise IEEE adds and multiplies are exact per
   element, so the result cannot depend on how torch splits work across threads or SIMD
   lanes. Attention reduces over a key buffer of fixed capacity ``C`` (invalid slots are
   -inf before the softmax and contribute exactly 0 after it): a softmax over only the
   ``i + 1`` valid keys would change the tree shape and so the bits.
2. **Transcendentals are built from correctly rounded ops.** torch's CPU ``exp`` uses a
   SIMD polynomial for full vectors and libm for the tail of a buffer (and of each thread's
   chunk), and the two may differ in the last bit, so where an element lands decides its
   value. ``exp_strict`` / ``log_strict`` use only ``+ - * /``, ``round`` and exponent-bit
   arithmetic, all exact or correctly rounded in both paths (about 2 ulp from libm).
   RMSNorm's ``sqrt`` is torch's: on some CPU builds (AVX-512, torch 2.x) it is not the
   correctly rounded square root, but its vector body and scalar tail agree, so it keeps batch
   invariance; strict bits may then differ between CPUs.

On CPU, where autograd does not record, the linear's products and tree, attention's product
trees (and whole attention over key rows, ``attend_rows``), ``exp_strict`` and ``tree_sum``
run in one fused C kernel (``_ckernel``): the same IEEE ops on the same
pairs, so the same bits, without materialising the products (torch's path where it cannot be
built, or with ``POSTTRAIN_STRICT_CKERNEL=0``).

Activations are fp32 in both sets; parameters are upcast (exactly) to fp32 at use.
``FastOps`` uses BLAS matmuls and torch's softmax: same math, tolerance instead of bits.
Departure from HF/SGLang: strict results are not bitwise equal to theirs (their kernels
reduce in other orders); conformance to ``transformers`` is a tolerance test.

The contract is the forward's (train == decode bit for bit). The backward has none beyond
run-to-run determinism: ``_StrictLinear``, ``_ProductTreeSum`` (attention), ``_TreeSum`` and
``_ExpStrict`` differentiate the strict forward with BLAS matmuls and one-op gradients, equal
to autograd's gradient of the forward's ops to fp32 rounding, not bit for bit (as the CUDA
strict set's backward, ``_strict_cuda``); the same bits run to run for fixed shapes at a fixed
thread count. Attention over key rows (``attend_rows``: the packed training forward and
decode, through the fused C kernel) is differentiated by ``_row_attention``'s torch backward,
also to fp32 rounding. ``_CUSTOM_BACKWARD = False`` selects autograd's own (benchmarks, tests).
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.models import _ckernel
from posttrain.models._row_attention import PackedRuns, RowAttention

_INV_LN2 = 1.4426950408889634
_LN2_HI = 0.693359375  # 9 significant bits, so k * _LN2_HI is exact for |k| < 2**15
_LN2_LO = -2.12194440e-4
_SQRT2 = 1.4142135623730951
_EXP_COEFFS = tuple(1.0 / math.factorial(n) for n in range(7, -1, -1))  # Taylor, |r| <= ln2/2
_EXP_COEFFS_F32 = torch.tensor(_EXP_COEFFS, dtype=torch.float32)  # as torch rounds them
_LOG_COEFFS = tuple(1.0 / n for n in (11, 9, 7, 5, 3, 1))  # atanh series in z**2
# Elements of the product tensors ``linear`` materialises at once (its forward's products and
# trees: every row is reduced alone, so the row blocking cannot change a bit); bounds memory
# only. Fewer, larger blocks: far fewer torch ops per linear.
_BLOCK_ELEMENTS = 1 << 21
# Whether the strict kernels use their own backwards (BLAS matmuls and one-op gradients:
# autograd's gradients to fp32 rounding, not its bits); False differentiates the forward's
# own ops with autograd, the reference for benchmarks and tests only.
_CUSTOM_BACKWARD = True


def tree_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over ``dim`` by a pairwise tree of elementwise adds (zero-padded to 2**k).

    Level by level, element ``i`` is added to element ``i + half``. The reduced dim is moved
    to the front first so each level adds two contiguous blocks (vectorised, no strides);
    the pairing, and so every bit of the result, is the same for any ``dim`` layout. Where
    autograd does not record, the fused C kernel (``_ckernel.tree_sum``) reads ``x`` in place.
    """
    if not (_CUSTOM_BACKWARD and x.requires_grad and torch.is_grad_enabled()):
        fused = _ckernel.tree_sum(x, dim)
        if fused is not None:
            return fused
    if dim not in (0, -x.ndim):
        x = x.movedim(dim, 0).contiguous()
    n = x.shape[0]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros((width - n, *x.shape[1:]))])
    if _CUSTOM_BACKWARD and x.requires_grad and torch.is_grad_enabled():
        out: Tensor = _TreeSum.apply(x)  # type: ignore[no-untyped-call]
        return out
    return _tree_levels(x)


def _tree_levels(x: Tensor) -> Tensor:
    """The pairwise tree over dim 0 of ``x`` (its length a power of two)."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def _tree_sum_owned(x: Tensor) -> Tensor:
    """``tree_sum(x, dim=0)`` for a tensor nothing else holds (products just made): the levels
    add in place into its first half (the same adds, so the same bits, without a new tensor
    per level) unless autograd records them. Returns a new tensor, not a view of ``x``."""
    if torch.is_grad_enabled() and x.requires_grad:
        return tree_sum(x, dim=0)
    n = x.shape[0]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros((width - n, *x.shape[1:]))])
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half].add_(x[half:])
    return x[0].clone()


class _TreeSum(torch.autograd.Function):
    """``_tree_levels`` with a backward of no arithmetic.

    Every input of the tree reaches the output with weight exactly 1, so each input row's
    gradient is the output's gradient: repeated over the rows (a view). Autograd's own backward
    of the levels builds it from zero-filled slices, level by level, at more cost than the
    forward; its values are the same but for signed zeros (``-0.0`` arrives as ``+0.0``).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.rows = x.shape[0]
        fused = _ckernel.tree_sum(x, 0)
        return _tree_levels(x) if fused is None else fused

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.expand(ctx.rows, *grad.shape)


def product_tree_sum(a: Tensor, b: Tensor) -> Tensor:
    """``tree_sum(a * b, dim=0)`` (``a``, ``b`` broadcast together, of one ndim).

    The backward contracts the output gradient with the other operand by ``torch.einsum``
    (BLAS batched matmuls): the gradient of the sum of products to fp32 rounding, not the bits
    of autograd's products and sums. Deterministic run to run for fixed shapes and threads.
    """
    if _CUSTOM_BACKWARD and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        out: Tensor = _ProductTreeSum.apply(a, b)  # type: ignore[no-untyped-call]
        return out
    return _product_tree_forward(a, b)


def _product_tree_forward(a: Tensor, b: Tensor) -> Tensor:
    """``_tree_sum_owned(a * b)``: attention's batched-matmul shapes through the fused C kernel
    (``_ckernel.product_tree``, the same bits) where it applies, else torch's products."""
    fused = _ckernel.product_tree(a, b)
    return _tree_sum_owned(a * b) if fused is None else fused


class _ProductTreeSum(torch.autograd.Function):
    """``product_tree_sum``'s autograd function."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        with torch.no_grad():
            return _product_tree_forward(a, b)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        g = grad[None]  # the output gradient, broadcast over the reduced dim 0
        grad_a = _contract(g, b, a.shape) if need_a else None
        grad_b = _contract(g, a, b.shape) if need_b else None
        return grad_a, grad_b


def _contract(g: Tensor, other: Tensor, shape: torch.Size) -> Tensor:
    """``(g * other).sum_to_size(shape)`` without the products: one ``torch.einsum`` over the
    dims of size > 1 (every operand of one ndim; a dim of ``shape`` neither input has is
    broadcast after)."""
    letters = "abcdefghijklmnopqrstuvwxyz"[: len(shape)]

    def spec(sizes: tuple[int, ...] | torch.Size) -> tuple[str, tuple[int, ...]]:
        ones = tuple(i for i, n in enumerate(sizes) if n == 1)
        return "".join(c for i, c in enumerate(letters) if i not in ones), ones

    (g_in, g_ones), (o_in, o_ones), (out, _) = spec(g.shape), spec(other.shape), spec(shape)
    made = "".join(c for c in out if c in g_in or c in o_in)
    res = torch.einsum(f"{g_in},{o_in}->{made}", g.squeeze(g_ones), other.squeeze(o_ones))
    for i, c in enumerate(letters):  # the size-1 dims back, as views (einsum's layout kept)
        if c not in made:
            res = res.unsqueeze(i)
    return res.expand(shape)


def _block_rows(k: int, n: int) -> int:
    """Rows per block of a ``[K, rows, N]`` product that ``_BLOCK_ELEMENTS`` bounds (>= 1)."""
    return max(1, _BLOCK_ELEMENTS // max(1, n * k))


def _strict_linear_rows(rows: Tensor, w_t: Tensor) -> Tensor:
    """``rows[R, K] @ w`` for ``w_t[K, 1, N]`` (``w.t()``): products, then ``tree_sum`` over K.

    Rows are reduced independently, so the row blocks (as many rows as ``_BLOCK_ELEMENTS``
    allows) never change a bit.

    Where autograd does not record (the trainer's ``_StrictLinear.forward``, the engine), CPU
    fp32 runs the fused C kernel (``_ckernel``): the same multiplies and adds, so the same
    bits, without the product tensor (torch's path below where it cannot be built)."""
    fused = _ckernel.strict_linear(rows, w_t)
    if fused is not None:
        return fused
    k, n = w_t.shape[0], w_t.shape[2]
    step = _block_rows(k, n)
    parts = [
        _tree_sum_owned(rows[i : i + step].t().contiguous()[:, :, None] * w_t)  # [K, rows, N]
        for i in range(0, rows.shape[0], step)
    ]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else rows.new_zeros((0, n))


class _StrictLinear(torch.autograd.Function):
    """``_strict_linear_rows`` (the forward, bit for bit) with a BLAS backward.

    ``grad_x = G @ w`` and ``grad_w = G.t() @ rows``: the gradients of the linear map to fp32
    rounding, not the bits autograd's products and sums would give; deterministic run to run
    for fixed shapes at a fixed thread count (training needs no batch invariance, as on CUDA,
    ``_strict_cuda``). The weight's gradient only when it is needed (LoRA's frozen base weights
    need none).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(rows, w)
        with torch.no_grad():
            return _strict_linear_rows(rows, w.t().contiguous()[:, None, :])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        rows, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad
        grad_x = grad @ w if need_x else None
        grad_w = grad.t() @ rows if need_w else None
        return grad_x, grad_w


def _pow2(k: Tensor) -> Tensor:
    """2.0**k as fp32 for integral k in [-126, 127], built from exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exp_strict(x: Tensor) -> Tensor:
    """exp(x) in fp32 from correctly rounded ops only (inputs clamped to [-87, 88])."""
    if _CUSTOM_BACKWARD and x.requires_grad and torch.is_grad_enabled():
        out: Tensor = _ExpStrict.apply(x)  # type: ignore[no-untyped-call]
        return out
    fused = _ckernel.exp_strict(x, _EXP_COEFFS_F32)
    return _exp_torch(x) if fused is None else fused


def _exp_torch(x: Tensor) -> Tensor:
    """``exp_strict`` in torch ops (the fused C kernel's reference: the same fp32 ops)."""
    x = x.clamp(-87.0, 88.0)
    k = torch.round(x * _INV_LN2).detach()
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    return p * _pow2(k)


class _ExpStrict(torch.autograd.Function):
    """``exp_strict`` with exp's own derivative, ``grad * out``, in one node (0 where the clamp
    cuts). Autograd of the Horner ops gives ``2**k * p'(r)``, the degree-6 Taylor polynomial:
    the same to fp32 rounding (``|r| <= ln2/2``), not the same bits."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        with torch.no_grad():
            out = exp_strict(x)  # no graph: exp_strict's own forward
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x, out = ctx.saved_tensors
        inside = (x >= -87.0).logical_and_(x <= 88.0)
        return torch.where(inside, grad * out, torch.zeros((), dtype=out.dtype))


def log_strict(x: Tensor) -> Tensor:
    """log(x) in fp32 for positive normal x, from correctly rounded ops only."""
    bits = x.detach().contiguous().view(torch.int32)
    e = ((bits >> 23) & 255) - 127
    m = x * _pow2(-e)  # in [1, 2), exact
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    ef = (e + big.to(torch.int32)).to(torch.float32)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    q = torch.full_like(z, _LOG_COEFFS[0])
    for c in _LOG_COEFFS[1:]:
        q = q * z2 + c
    return ef * _LN2_HI + (ef * _LN2_LO + 2.0 * z * q)


def _rms_norm_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``StrictOps.rms_norm`` in torch ops (the fused C kernel's reference: the same ops)."""
    ms = tree_sum(x * x) / x.shape[-1]
    inv = 1.0 / torch.sqrt(ms + eps)
    return (x * inv[..., None]) * weight.float()


class _RoutedExperts(torch.autograd.Function):
    """``StrictOps.routed_experts``: the fused kernel's output (computed before, passed in) with
    a backward in torch ops, expert by expert over the kernel's grouping of the pairs:
    ``_StrictLinear``'s matmul gradients and ``_SiluMul``'s derivative, each pair's input
    gradient added into its token's row in order (deterministic run to run; the expert loop's
    gradient to fp32 rounding)."""

    @staticmethod
    def forward(
        ctx: Any, m: Tensor, fc1: Tensor, fc2: Tensor, k: int, fused: _ckernel.RoutedExperts
    ) -> Tensor:
        ctx.save_for_backward(m, fc1, fc2, fused.order, fused.gate_up, fused.act)
        ctx.k, ctx.sizes = k, fused.sizes
        return fused.out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        m, fc1, fc2, order, gate_up, act = ctx.saved_tensors
        need_m, need_fc1, need_fc2 = ctx.needs_input_grad[:3]
        inter = fc2.shape[2]
        dy_all = grad.reshape(-1, grad.shape[-1])[order]  # [P, H], grouped by expert
        tok_all = order // ctx.k
        d_m = torch.zeros_like(m) if need_m else None
        d_fc1 = torch.zeros_like(fc1) if need_fc1 else None
        d_fc2 = torch.zeros_like(fc2) if need_fc2 else None
        first = 0
        for e, size in enumerate(ctx.sizes):
            if size == 0:
                continue
            rows = slice(first, first + size)
            first += size
            dy, a, gu, tok = dy_all[rows], act[rows], gate_up[rows], tok_all[rows]
            if d_fc2 is not None:
                d_fc2[e] = dy.t() @ a
            if d_m is None and d_fc1 is None:
                continue
            d_act = dy @ fc2[e].float()
            d_gu = torch.cat(_silu_mul_grads(gu[:, :inter], gu[:, inter:], d_act), 1)
            if d_fc1 is not None:
                d_fc1[e] = d_gu.t() @ m[tok]
            if d_m is not None:
                d_m.index_add_(0, tok, d_gu @ fc1[e].float())
        return d_m, d_fc1, d_fc2, None, None


class _RmsNorm(torch.autograd.Function):
    """``StrictOps.rms_norm`` (the fused kernel's bits) with RMSNorm's gradient in a few torch
    ops: ``dx = inv * gw - x * inv**3 * mean(gw * x)`` (``gw = grad * weight``) and
    ``dweight = sum over rows of grad * x * inv``; equal to autograd's gradient of the strict
    ops to fp32 rounding, deterministic run to run."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = _ckernel.rms_norm(x, weight, eps)
        if out is None:
            out = _rms_norm_torch(x, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        fused = _ckernel.rms_norm_backward(x, weight, ctx.eps, grad)
        if fused is not None:  # the same formulas in one pass (sequential sums)
            dx_f, dw_f = fused
            return (dx_f if need_x else None), (dw_f.to(weight.dtype) if need_w else None), None
        w = weight.float()
        inv = torch.rsqrt((x * x).mean(-1, keepdim=True) + ctx.eps)
        dx = dw = None
        if need_x:
            gw = grad * w
            dx = inv * gw - x * (inv * inv * inv) * (gw * x).mean(-1, keepdim=True)
        if need_w:
            dw = (grad * x * inv).reshape(-1, *weight.shape).sum(0).to(weight.dtype)
        return dx, dw, None


def _silu_mul_torch(gate: Tensor, up: Tensor) -> Tensor:
    """``StrictOps.silu_mul`` in torch ops (the fused C kernel's reference: the same ops)."""
    return (gate / (1.0 + exp_strict(-gate))) * up


class _SiluMul(torch.autograd.Function):
    """``StrictOps.silu_mul`` (the fused kernel's bits) with SiLU's derivative in torch ops:
    ``dgate = grad * up * s * (1 + gate * (1 - s))``, ``dup = grad * gate * s`` for
    ``s = sigmoid(gate)``; autograd's gradient of the strict ops to fp32 rounding."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        out = _ckernel.silu_mul(gate, up, _EXP_COEFFS_F32)
        ctx.save_for_backward(gate, up)
        return _silu_mul_torch(gate, up) if out is None else out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up = ctx.saved_tensors
        d_gate, d_up = _silu_mul_grads(gate, up, grad)
        return (d_gate if ctx.needs_input_grad[0] else None), (
            d_up if ctx.needs_input_grad[1] else None
        )


def _silu_mul_grads(gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of ``silu(gate) * up`` for ``grad``: ``(dgate, dup)``."""
    s = torch.sigmoid(gate)
    return grad * up * s * (1.0 + gate * (1.0 - s)), grad * gate * s


class FastOps:
    """Ordinary torch kernels (BLAS, torch softmax); fp32 activations; not batch invariant."""

    attention_chunk_elements: ClassVar[int] = 1 << 25
    """Queries per attention call in ``_blocks.attend_buffers``: at most this many
    ``heads * capacity * head_dim`` elements. Bounds memory only; batched einsums need no
    materialised products, so fast mode takes chunks 256x larger (8 queries per call on a
    2048-slot cache with 16 heads of dim 128, where strict takes 1)."""

    compute_dtype: ClassVar[torch.dtype] = torch.float32
    """The dtype the matmuls run in (``Bf16FastOps``: bf16; every other set: fp32)."""

    batch_invariant: ClassVar[bool] = False
    """Whether a token's bits are independent of the call (the strict sets): only kernel sets
    without that contract may take library fast paths (SDPA, grouped expert GEMMs)."""

    @classmethod
    def uses_row_attention(cls, q: Tensor) -> bool:
        """Whether ``attend_rows`` runs for queries like ``q`` (the strict sets: on CUDA, and
        on CPU where the fused C kernel is built): ``_blocks`` then uses it for attention
        without a relative position bias, on the packed forward and on decode alike."""
        return False

    @staticmethod
    def attend_rows(
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
        """Causal attention of ``q[T, heads, hd]`` over key rows: query ``t`` sees slot
        ``c <= pos[t]`` (and ``pos[t] - c < window``) at ``keys/values[kstart[t] + c]``
        (``[S, kv_heads, hd]``). Returns ``[T, heads * hd]``. ``runs``: the packed training
        layout's host facts where the caller has them (``PackedRuns``: the backward then
        needs no host sync). Only where ``uses_row_attention``."""
        raise NotImplementedError("attend_rows needs a strict kernel set (uses_row_attention)")

    @staticmethod
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` in fp32."""
        return F.linear(x, weight.float())

    @staticmethod
    def sum_last(x: Tensor) -> Tensor:
        """Sum over the last dim."""
        return x.sum(-1)

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """HF Qwen3 RMSNorm in fp32 (a low-precision input is upcast first): torch's fused
        ``rms_norm`` over the last dim with the weight in the same kernel, or, for a per-head
        weight (``[heads, hd]``), times the weight after."""
        if weight.dim() == 1:
            return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps=eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float()

    @staticmethod
    def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
        """``silu(gate) * up``."""
        return F.silu(gate) * up

    @classmethod
    def silu_mul_halves(cls, gu: Tensor) -> Tensor:
        """``silu_mul(gu[..., :C], gu[..., C:])`` for ``gu[..., 2C] = [gate; up]`` (a kernel set
        may take the whole tensor at once: one gradient instead of two slices')."""
        c = gu.shape[-1] // 2
        return cls.silu_mul(gu[..., :c], gu[..., c:])

    @classmethod
    def norm_rope(
        cls, x: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """Attention's query/key preparation for ``x[T, heads, hd]``: ``rms_norm`` by ``weight``
        (``[hd]`` or ``[heads, hd]``; None: no norm), then ``apply_rope`` by ``cos/sin[T, hd]``
        (a kernel set may fuse the two: one pass, one gradient)."""
        if weight is not None:
            x = cls.rms_norm(x, weight, eps)
        return apply_rope(x, cos, sin)

    @staticmethod
    def sigmoid(x: Tensor) -> Tensor:
        """``1 / (1 + exp(-x))``."""
        return torch.sigmoid(x)

    @staticmethod
    def sconv(windows: Tensor, weight: Tensor) -> Tensor:
        """Residual depthwise conv: ``windows[-1] + sum_i weight[:, i] * windows[i]``.

        ``windows[W, T, C]`` holds each token's ``W`` taps, oldest first (the last one is the
        token itself; taps outside its sequence are 0); ``weight[C, W]``. Returns ``[T, C]``.
        """
        return windows[-1] + (weight.float().t()[:, None, :] * windows).sum(0)

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        """Log-softmax over the last dim."""
        return torch.log_softmax(x, dim=-1)

    @staticmethod
    def softmax(x: Tensor) -> Tensor:
        """Softmax over the last dim."""
        return torch.softmax(x, dim=-1)

    @staticmethod
    def attention(
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        valid: Tensor,
        scale: float,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Attention of ``q[T, nkv, g, hd]`` over per-query buffers ``keys/values[T, C, nkv, hd]``.

        ``valid[T, C]`` marks the keys each query may see; ``bias[T, nkv, g, C]`` (fp32) is
        added to the scores after scaling; returns ``[T, nkv, g, hd]``.
        """
        scores = torch.einsum("tkgd,tckd->tkgc", q, keys) * scale
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("tkgc,tckd->tkgd", probs, values)

    @staticmethod
    def moe_combine(weights: Tensor, outputs: Tensor) -> Tensor:
        """``sum_j weights[:, j] * outputs[:, j]`` for ``weights[T, k]``, ``outputs[T, k, H]``."""
        return (weights[..., None] * outputs).sum(1)

    @classmethod
    def routed_experts(cls, m: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor | None:
        """A MoE layer's routed expert outputs ``[T, k, H]`` (slot order of ``ids[T, k]``) for
        ``m[T, H]``, ``fc1[E, 2I, H] = [gate; up]``, ``fc2[E, H, I]`` as one fused op, or
        ``None`` where this set has none for these operands (the model then runs its own: grouped
        GEMMs in fast numerics, expert by expert in strict)."""
        return None


class Bf16FastOps(FastOps):
    """``FastOps`` with the matmuls in bf16: what mixed-precision training computes.

    Linears take bf16 inputs and weights (FSDP's bf16 compute copy) and give bf16 outputs;
    norms, softmaxes, the router, the residual stream (a bf16 output added to the fp32 stream
    stays fp32) and the logits' log-softmax are fp32. Attention runs in bf16 (SDPA).

    Weights: under the GRPO trainer (``precision="bf16"``) FSDP2's ``MixedPrecisionPolicy``
    casts each layer's fp32 master shards to bf16 once per all-gather, so the ``weight`` cast
    in ``linear`` is a no-op there (a plain fp32 model pays it per call). Every parameter of a
    unit takes that dtype, norm and router weights included: the norm's arithmetic and the
    router's softmax run in fp32 on bf16-rounded weights (``weight.float()``), and the router's
    logits come from a bf16 matmul.
    """

    compute_dtype: ClassVar[torch.dtype] = torch.bfloat16

    @staticmethod
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` with both in bf16; bf16 out."""
        return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16))

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        """Log-softmax over the last dim, in fp32."""
        return torch.log_softmax(x.float(), dim=-1)

    @staticmethod
    def softmax(x: Tensor) -> Tensor:
        """Softmax over the last dim, in fp32."""
        return torch.softmax(x.float(), dim=-1)

    @staticmethod
    def sigmoid(x: Tensor) -> Tensor:
        """Sigmoid in fp32."""
        return torch.sigmoid(x.float())

    @staticmethod
    def attention(
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        valid: Tensor,
        scale: float,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``FastOps.attention`` in fp32 (the buffered path: windows, biases, decode)."""
        return FastOps.attention(q.float(), keys.float(), values.float(), valid, scale, bias)


class StrictOps(FastOps):
    """Batch-invariant, thread-count-invariant fp32 kernels (see the module docstring)."""

    batch_invariant: ClassVar[bool] = True

    @classmethod
    def uses_row_attention(cls, q: Tensor) -> bool:
        """On CPU fp32 where the fused C kernel is built (``_ckernel.row_attention``); not
        for autograd's own reference graph (``_CUSTOM_BACKWARD = False``)."""
        if not _CUSTOM_BACKWARD and torch.is_grad_enabled():
            return False
        return q.device.type == "cpu" and q.dtype == torch.float32 and _ckernel.available()

    @staticmethod
    def attend_rows(
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
        """``FastOps.attend_rows`` through the fused C kernel: per query, ``attention``'s
        ops over its own key rows (the bits of the torch path over any buffer width), without
        gathering a key buffer per query. Under autograd, ``RowAttention``'s torch backward."""

        def run(q: Tensor, keys: Tensor, values: Tensor, kstart: Tensor, pos: Tensor) -> Tensor:
            out = _ckernel.row_attention(
                q, keys, values, kstart, pos, scale=scale, window=window, coeffs=_EXP_COEFFS_F32
            )
            if out is None:
                raise RuntimeError("the fused strict C kernel's row attention did not run")
            return out

        if torch.is_grad_enabled() and (
            q.requires_grad or keys.requires_grad or values.requires_grad
        ):
            own = functools.partial(
                _ckernel.row_attention_backward,
                scale=scale,
                window=window,
                coeffs=_EXP_COEFFS_F32,
            )
            out: Tensor = RowAttention.apply(  # type: ignore[no-untyped-call]
                q, keys, values, kstart, pos, scale, window, run, torch.float32, own, runs
            )
            return out
        return run(q, keys, values, kstart, pos)

    attention_chunk_elements: ClassVar[int] = 1 << 17
    """Strict attention materialises its products (``[hd, T, heads, C]``) for ``tree_sum``:
    small chunks. Each query is reduced alone, so the chunking never changes its bits."""

    @staticmethod
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` as products plus ``tree_sum`` over K; each row computed alone."""
        w = weight.float()
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        grad = torch.is_grad_enabled() and (rows.requires_grad or w.requires_grad)
        if _CUSTOM_BACKWARD and grad and rows.shape[0]:  # no rows: no graph, as before
            out: Tensor = _StrictLinear.apply(rows, w)  # type: ignore[no-untyped-call]
        else:  # without a graph, or autograd's own of the products and trees (the reference)
            out = _strict_linear_rows(rows, w.t().contiguous()[:, None, :])
        return out.reshape(*lead, w.shape[0])

    @staticmethod
    def sum_last(x: Tensor) -> Tensor:
        """``tree_sum`` over the last dim."""
        return tree_sum(x)

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm: ``x * (1 / sqrt(tree_sum(x*x) / H + eps)) * weight``; through the fused C
        kernel where it applies (``_ckernel.rms_norm``, the same bits), under autograd with
        ``_RmsNorm``'s backward."""
        recording = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if recording and _CUSTOM_BACKWARD and x.device.type == "cpu" and _ckernel.available():
            out: Tensor = _RmsNorm.apply(x, weight, eps)  # type: ignore[no-untyped-call]
            return out
        fused = _ckernel.rms_norm(x, weight, eps)
        return _rms_norm_torch(x, weight, eps) if fused is None else fused

    @staticmethod
    def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
        """``gate / (1 + exp_strict(-gate)) * up``; through the fused C kernel where it applies
        (``_ckernel.silu_mul``, the same bits), under autograd with ``_SiluMul``'s backward."""
        recording = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
        if recording and _CUSTOM_BACKWARD and gate.device.type == "cpu" and _ckernel.available():
            out: Tensor = _SiluMul.apply(gate, up)  # type: ignore[no-untyped-call]
            return out
        fused = _ckernel.silu_mul(gate, up, _EXP_COEFFS_F32)
        return _silu_mul_torch(gate, up) if fused is None else fused

    @staticmethod
    def sigmoid(x: Tensor) -> Tensor:
        """``1 / (1 + exp_strict(-x))``."""
        return 1.0 / (1.0 + exp_strict(-x))

    @staticmethod
    def sconv(windows: Tensor, weight: Tensor) -> Tensor:
        """``windows[-1] + tree_sum_i(weight[:, i] * windows[i])``: fixed order over the taps."""
        return windows[-1] + tree_sum(weight.float().t()[:, None, :] * windows, dim=0)

    @staticmethod
    def log_softmax(x: Tensor) -> Tensor:
        """``z - log(tree_sum(exp(z)))`` with ``z = x - max(x)``."""
        z = x - x.detach().amax(-1, keepdim=True)
        return z - log_strict(tree_sum(exp_strict(z)))[..., None]

    @staticmethod
    def softmax(x: Tensor) -> Tensor:
        """``exp(z) / tree_sum(exp(z))`` with ``z = x - max(x)``."""
        e = exp_strict(x - x.detach().amax(-1, keepdim=True))
        return e / tree_sum(e)[..., None]

    @staticmethod
    def attention(
        q: Tensor,
        keys: Tensor,
        values: Tensor,
        valid: Tensor,
        scale: float,
        bias: Tensor | None = None,
    ) -> Tensor:
        """Attention over the full capacity ``C``: scores ``[C]``, masked softmax, ``tree_sum`` over C."""
        # products laid out [hd, T, nkv, g, C]: the reduced dim leads. The fused kernel reads the
        # permuted views in place; torch's products (and their saved inputs) get them contiguous.
        views = _ckernel.reads_views(q, keys, values, *(() if bias is None else (bias,)))

        def lead(x: Tensor) -> Tensor:
            return x if views else x.contiguous()

        k_t = lead(keys.permute(3, 0, 2, 1))[:, :, :, None, :]  # [hd, T, nkv, 1, C]
        scores = product_tree_sum(lead(q.permute(3, 0, 1, 2))[..., None], k_t) * scale
        # [T, nkv, g, C]
        if bias is not None:
            scores = scores + bias
        mask = valid[:, None, None, :]
        z = scores - scores.masked_fill(~mask, float("-inf")).detach().amax(-1, keepdim=True)
        e = torch.where(mask, exp_strict(z.masked_fill(~mask, 0.0)), 0.0)
        probs = e / tree_sum(e)[..., None]
        v_t = lead(values.permute(1, 0, 2, 3))[:, :, :, None, :]  # [C, T, nkv, 1, hd]
        return product_tree_sum(lead(probs.permute(3, 0, 1, 2))[..., None], v_t)  # [T, nkv, g, hd]

    @classmethod
    def routed_experts(cls, m: Tensor, ids: Tensor, fc1: Tensor, fc2: Tensor) -> Tensor | None:
        """On CPU fp32 where the fused C kernel is built (``_ckernel.routed_experts``): every
        (token, slot) pair through ``linear`` of its expert's ``fc1``, ``silu_mul`` and
        ``linear`` of its ``fc2``, the bits of the expert-by-expert loop, in one call; under
        autograd with ``_RoutedExperts``' backward (not for autograd's own reference graph,
        ``_CUSTOM_BACKWARD = False``)."""
        recording = torch.is_grad_enabled() and (
            m.requires_grad or fc1.requires_grad or fc2.requires_grad
        )
        if (recording and not _CUSTOM_BACKWARD) or m.device.type != "cpu":
            return None
        with torch.no_grad():
            fused = _ckernel.routed_experts(
                m.detach(), ids, fc1.detach().float(), fc2.detach().float(), _EXP_COEFFS_F32
            )
        if fused is None or not recording:
            return None if fused is None else fused.out
        out: Tensor = _RoutedExperts.apply(m, fc1, fc2, ids.shape[1], fused)  # type: ignore[no-untyped-call]
        return out

    @staticmethod
    def moe_combine(weights: Tensor, outputs: Tensor) -> Tensor:
        """``acc = w_0 * y_0; acc = acc + w_j * y_j`` for the slots in order (ascending expert id)."""
        acc = weights[:, 0, None] * outputs[:, 0]
        for j in range(1, weights.shape[1]):
            acc = acc + weights[:, j, None] * outputs[:, j]
        return acc


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x[T, heads, hd]`` and ``cos/sin[T, hd]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
