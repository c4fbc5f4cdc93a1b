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

On CPU, where autograd does not record, the linear's products and tree, attention's product
trees, ``exp_strict`` and ``tree_sum`` run in one fused C kernel (``_ckernel``): the same IEEE ops on the same
pairs, so the same bits, without materialising the products (torch's path where it cannot be
built, or with ``POSTTRAIN_STRICT_CKERNEL=0``).

Activations are fp32 in both sets; parameters are upcast (exactly) to fp32 at use.
``FastOps`` uses BLAS matmuls and torch's softmax: same math, tolerance instead of bits.
Departure from HF/SGLang: strict results are not bitwise equal to theirs (their kernels
reduce in other orders); conformance to ``transformers`` is a tolerance test.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.models import _ckernel

_INV_LN2 = 1.4426950408889634
_LN2_HI = 0.693359375  # 9 significant bits, so k * _LN2_HI is exact for |k| < 2**15
_LN2_LO = -2.12194440e-4
_SQRT2 = 1.4142135623730951
_EXP_COEFFS = tuple(1.0 / math.factorial(n) for n in range(7, -1, -1))  # Taylor, |r| <= ln2/2
_EXP_COEFFS_F32 = torch.tensor(_EXP_COEFFS, dtype=torch.float32)  # as torch rounds them
_LOG_COEFFS = tuple(1.0 / n for n in (11, 9, 7, 5, 3, 1))  # atanh series in z**2
# Elements per row chunk of the [K, rows, N] product tensor of ``linear`` as autograd
# differentiated it: the weight's gradient is a sum over each chunk's rows, the chunks' sums
# added last chunk first, so this size fixes the weight gradient's bits (kept as it was).
_CHUNK_ELEMENTS = 1 << 17
# Elements of the product tensors ``linear`` materialises at once where the row blocking
# cannot change a bit (the forward's products and trees, the input's gradient: every row is
# reduced alone); bounds memory only. Fewer, larger blocks: far fewer torch ops per linear.
_BLOCK_ELEMENTS = 1 << 21
# Whether the strict kernels use their hand-written backwards (bit for bit autograd's own
# gradients, far fewer ops); False selects autograd's, for benchmarks and tests only.
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
    """``_tree_levels`` with a one-op backward.

    Every input of the tree reaches the output with weight exactly 1, so each input row's
    gradient is the output's gradient. Autograd's own backward of the levels builds it from
    zero-filled slices added together (``g + 0``, level by level: ``-0.0`` becomes ``+0.0``,
    every other value is exact), which cost more than the forward; this gives the same bits
    (``g + 0.0``, materialised contiguous as autograd's was) in one copy.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.rows = x.shape[0]
        fused = _ckernel.tree_sum(x, 0)
        return _tree_levels(x) if fused is None else fused

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return (grad + 0.0).expand(ctx.rows, *grad.shape).contiguous()


def product_tree_sum(a: Tensor, b: Tensor) -> Tensor:
    """``tree_sum(a * b, dim=0)`` (``a``, ``b`` broadcast together); gradients as autograd's.

    The backward is autograd's for the product and the tree (``sum_to_size(G * b)`` and
    ``sum_to_size(G * a)`` with ``G`` the output gradient ``+ 0.0`` repeated over dim 0,
    see ``_TreeSum``), without walking the tree's levels.
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
        g = (grad + 0.0).expand(max(a.shape[0], b.shape[0]), *grad.shape)
        # The products are written into one contiguous buffer of the broadcast shape: the
        # layout autograd's products had (its repeated gradient was materialised contiguous),
        # so each ``sum_to_size`` reduces in the same order, without copying ``g`` first.
        need_a, need_b = ctx.needs_input_grad
        products = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        grad_a = torch.mul(g, b, out=products).sum_to_size(a.shape) if need_a else None
        if grad_a is not None and grad_a.shape == products.shape:  # no reduction: it is the buffer
            products = torch.empty_like(products)
        grad_b = torch.mul(g, a, out=products).sum_to_size(b.shape) if need_b else None
        return grad_a, grad_b


def _linear_step(k: int, n: int) -> int:
    """Rows per chunk of the ``[K, rows, N]`` product tensor as autograd saw it (see
    ``_CHUNK_ELEMENTS``): the weight gradient's row chunks."""
    return max(1, _CHUNK_ELEMENTS // max(1, n * k))


def _block_rows(k: int, n: int, multiple: int = 1) -> int:
    """Rows per block of a ``[K, rows, N]`` product that ``_BLOCK_ELEMENTS`` bounds: a
    multiple of ``multiple`` rows (at least one multiple)."""
    return max(1, _BLOCK_ELEMENTS // max(1, n * k * multiple)) * multiple


def _strict_linear_rows(rows: Tensor, w_t: Tensor, step: int | None = None) -> Tensor:
    """``rows[R, K] @ w`` for ``w_t[K, 1, N]`` (``w.t()``): products, then ``tree_sum`` over K.

    Rows are reduced independently, so the row blocks (``step`` rows each, by default as many
    as ``_BLOCK_ELEMENTS`` allows) never change a bit; autograd's reference path passes the
    gradient chunks (``_linear_step``) so its graph is the one the trainer differentiated.

    Where autograd does not record (the trainer's ``_StrictLinear.forward``, the engine), CPU
    fp32 runs the fused C kernel (``_ckernel``): the same multiplies and adds, so the same
    bits, without the product tensor (torch's path below where it cannot be built)."""
    fused = _ckernel.strict_linear(rows, w_t)
    if fused is not None:
        return fused
    k, n = w_t.shape[0], w_t.shape[2]
    step = _block_rows(k, n) if step is None else step
    parts = [
        _tree_sum_owned(rows[i : i + step].t().contiguous()[:, :, None] * w_t)  # [K, rows, N]
        for i in range(0, rows.shape[0], step)
    ]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else rows.new_zeros((0, n))


def _strict_linear_grad_x(grad: Tensor, w_t: Tensor) -> Tensor:
    """``sum_N(G * w)`` per row: the input gradient autograd computes for a chunk of
    ``tree_sum(a * w_t)`` (``G`` the chunk's output gradient, broadcast over K), as ``[R, K]``.

    Every ``(row, k)`` is one inner-dim sum over N on its own (torch's per-row order), so one
    ``[rows, K, N]`` product per block gives autograd's bits without its chunks, transposes
    and concatenation."""
    k, n = w_t.shape[0], w_t.shape[2]
    w_kn = w_t[:, 0, :]  # [K, N]
    step = _block_rows(k, n)
    parts = [
        (grad[i : i + step, None, :] * w_kn).sum(2)  # [rows, K, N] -> [rows, K]
        for i in range(0, grad.shape[0], step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _strict_linear_grad_w(grad: Tensor, rows: Tensor, step: int) -> Tensor:
    """The weight gradient ``[K, N]`` (as ``w_t``'s ``[K, 1, N]`` without the 1) autograd gives
    for the chunks of ``step`` rows: per chunk ``sum_rows(G * a)`` (torch's reduction over the
    chunk's rows, ``a = rows.t()``), the chunks' sums added last chunk first.

    The products of many whole chunks are made at once and each chunk's rows summed as one
    dim of a ``[K, chunks, step, N]`` view: the same reduction, over the same rows, per chunk."""
    k, n = rows.shape[1], grad.shape[1]
    total = rows.shape[0]
    sums: list[Tensor] = []  # [K, N] per chunk, in chunk order
    block = _block_rows(k, n, step)
    whole = total - total % step
    for i in range(0, whole, block):
        m = min(block, whole - i)
        prod = grad[None, i : i + m, :] * rows[i : i + m].t().contiguous()[:, :, None]
        sums.extend(prod.view(k, m // step, step, n).sum(2).unbind(1))
    if whole < total:
        tail = grad[None, whole:, :] * rows[whole:].t().contiguous()[:, :, None]
        sums.append(tail.sum(1))
    out = sums[-1]
    for part in reversed(sums[:-1]):
        out = out + part
    return out


class _StrictLinear(torch.autograd.Function):
    """``_strict_linear_rows`` with the gradients autograd computes for it, in fewer ops.

    Autograd's backward of one chunk ``tree_sum(a * w_t)`` (``a = rows.t()[:, :, None]``) is
    ``grad_a = sum_N(G * w_t)`` and ``grad_w_t = sum_rows(G * a)`` with ``G`` the chunk's output
    gradient (``+ 0.0``: see ``_TreeSum``) broadcast over K; the chunks' ``grad_w_t`` add up
    last chunk first (autograd runs the chunk made last first), and the rows' gradients come
    back through zero-filled slices (``+ 0.0`` again when there is more than one chunk). This
    computes those same reductions on the same shapes, so every gradient bit is autograd's,
    without the slice and tree bookkeeping (``_strict_linear_grad_x``, ``_strict_linear_grad_w``);
    the weight's gradient only when it is needed (LoRA's frozen base weights need none).
    """

    @staticmethod
    def forward(ctx: Any, rows: Tensor, w: Tensor) -> Tensor:
        w_t = w.t().contiguous()[:, None, :]
        ctx.save_for_backward(rows, w_t)
        with torch.no_grad():
            return _strict_linear_rows(rows, w_t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        rows, w_t = ctx.saved_tensors
        k, n = w_t.shape[0], w_t.shape[2]
        step = _linear_step(k, n)
        need_x, need_w = ctx.needs_input_grad
        grad = grad + 0.0
        grad_x = None
        if need_x:
            grad_x = _strict_linear_grad_x(grad, w_t)
            if rows.shape[0] > step:  # more than one chunk: the zero-filled slices' ``+ 0.0``
                grad_x = grad_x + 0.0
        grad_w = _strict_linear_grad_w(grad, rows, step).t() if need_w else None
        return grad_x, grad_w


def _pow2(k: Tensor) -> Tensor:
    """2.0**k as fp32 for integral k in [-126, 127], built from exponent bits (exact)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exp_strict(x: Tensor) -> Tensor:
    """exp(x) in fp32 from correctly rounded ops only (inputs clamped to [-87, 88])."""
    if _CUSTOM_BACKWARD and x.requires_grad and torch.is_grad_enabled():
        out: Tensor = _ExpStrict.apply(x)  # type: ignore[no-untyped-call]
        return out
    fused = _ckernel.exp_terms(x, _EXP_COEFFS_F32, terms=False)
    return _exp_terms(x)[0] if fused is None else fused[0]


def _exp_terms(x: Tensor) -> tuple[Tensor, Tensor, list[Tensor], Tensor]:
    """``exp_strict(x)`` and what its backward reads: ``r`` (the reduced argument), the
    Horner terms ``p_0 .. p_6`` that ``r`` multiplies, and the scale ``2**k``. One pass of
    the fused C kernel where it applies (the same fp32 ops, so the same bits)."""
    fused = _ckernel.exp_terms(x, _EXP_COEFFS_F32, terms=True)
    if fused is not None:
        return fused[0], fused[1], list(fused[2:-1]), fused[-1]
    x = x.clamp(-87.0, 88.0)
    k = torch.round(x * _INV_LN2).detach()
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    terms = []
    for c in _EXP_COEFFS[1:]:
        terms.append(p)
        p = p * r + c
    scale = _pow2(k)
    return p * scale, r, terms, scale


class _ExpStrict(torch.autograd.Function):
    """``exp_strict`` with autograd's own gradient of its ops, in one node.

    Autograd differentiates ``p_i = p_{i-1} * r + c_i`` (``p_0`` constant) and ``out = p_7 *
    2**k`` (``k`` detached) last op first: ``g_7 = g * 2**k``, ``g_{i-1} = g_i * r``, and ``r``
    collects ``g_i * p_{i-1}`` in that order (``i = 7 .. 1``, each added to the sum so far);
    the subtractions pass it on and the clamp keeps it where ``-87 <= x <= 88`` (0 elsewhere).
    This computes exactly those products and sums, without a graph node per op."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        with torch.no_grad():
            out, r, terms, scale = _exp_terms(x)
        ctx.save_for_backward(x, r, scale, *terms)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x, r, scale, *terms = ctx.saved_tensors
        g = grad * scale
        total: Tensor | None = None
        for i in range(len(terms) - 1, -1, -1):
            part = g * terms[i]
            total = part if total is None else total + part
            if i:
                g = g * r
        assert total is not None
        inside = (x >= -87.0).logical_and_(x <= 88.0)
        return torch.where(inside, total, torch.zeros((), dtype=total.dtype))


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

    fused_row_attention: ClassVar[bool] = False
    """Whether ``attend_rows`` exists (the CUDA strict set): ``_blocks`` then uses it for
    attention without a relative position bias, on the packed forward and on decode alike."""

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
    ) -> Tensor:
        """Causal attention of ``q[T, heads, hd]`` over key rows: query ``t`` sees slot
        ``c <= pos[t]`` (and ``pos[t] - c < window``) at ``keys/values[kstart[t] + c]``
        (``[S, kv_heads, hd]``). Returns ``[T, heads * hd]``. Only kernel sets with
        ``fused_row_attention`` implement it."""
        raise NotImplementedError(
            "attend_rows needs a kernel set with fused_row_attention (CudaStrictOps)"
        )

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
        else:
            w_t = w.t().contiguous()[:, None, :]
            # autograd's own graph (the reference backward) over the gradient's row chunks
            step = _linear_step(w_t.shape[0], w_t.shape[2]) if grad else None
            out = _strict_linear_rows(rows, w_t, step)
        return out.reshape(*lead, w.shape[0])

    @staticmethod
    def sum_last(x: Tensor) -> Tensor:
        """``tree_sum`` over the last dim."""
        return tree_sum(x)

    @staticmethod
    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """RMSNorm: ``x * (1 / sqrt(tree_sum(x*x) / H + eps)) * weight``."""
        ms = tree_sum(x * x) / x.shape[-1]
        inv = 1.0 / torch.sqrt(ms + eps)
        return (x * inv[..., None]) * weight.float()

    @staticmethod
    def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
        """``gate / (1 + exp_strict(-gate)) * up``."""
        return (gate / (1.0 + exp_strict(-gate))) * up

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
