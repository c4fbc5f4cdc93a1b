"""Attention over key rows with a torch backward: the autograd function every strict kernel
set's ``attend_rows`` shares (``StrictOps`` on CPU through the fused C kernel, ``CudaStrictOps``
through Triton).

The forward is the kernel set's own (no graph: the bits the engine's decode computes). The
backward recomputes each key row's probabilities in torch and forms the three gradients with
batched matmuls: the gradient of the same attention to fp32 rounding (its exp is torch's, not
``exp_strict``), deterministic run to run, no atomics; the strict kernels' backwards promise
no more (``_ops``). The packed training layout (every token's keys are its own segment's
tokens, in order) goes through a few batched ops over the segments padded to the longest; other
layouts (decode-like key rows, gathered context-parallel keys) run by runs of one key row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

SDPA_BACKWARD_DEVICES: tuple[str, ...] = ("cuda",)
"""Devices where the packed layout's backward (no window) runs through torch's fused attention
(``_sdpa_backward``: flash attention's backward, no ``[L, L]`` scores in memory); elsewhere
the batched einsums below. Tests add ``"cpu"`` to run it here."""

_BACKWARD_CHUNK = 1 << 26
"""Elements of the ``[n, heads, L]`` score tensor per chunk of the backward (memory only)."""

RowForward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""A kernel set's attention forward over key rows: ``(q, keys, values, kstart, pos) -> out``."""


RowBackward = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], "tuple[Tensor, Tensor, Tensor] | None"
]
"""A kernel set's own attention backward: ``(q, keys, values, kstart, pos, grad) -> (dq, dk,
dv)``, or ``None`` where it does not apply (``row_attention_backward`` then runs)."""


class PackedRuns(NamedTuple):
    """The packed training layout's facts (every token's keys are its own segment's tokens, in
    order) as the caller that packed the tokens knows them on the host: each token's segment
    index, the number of segments and the longest. Given to ``attend_rows``, the backward
    takes them instead of checking and reading them back from the device (a host sync per
    layer)."""

    seg: Tensor
    segments: int
    longest: int


class RowAttention(torch.autograd.Function):
    """``forward(q, keys, values, kstart, pos)`` (the kernel set's, without a graph) with the
    kernel set's ``backward`` where it gives one, else ``row_attention_backward``; ``dtype``:
    the torch backward's matmul operand dtype (bf16 where the forward's dots were bf16);
    ``runs``: the packed layout's facts where the caller knows them (``PackedRuns``)."""

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
        forward: RowForward,
        dtype: torch.dtype,
        backward: RowBackward | None = None,
        runs: PackedRuns | None = None,
    ) -> Tensor:
        out = forward(q, keys, values, kstart, pos)
        ctx.save_for_backward(q, keys, values, kstart, pos, out)
        ctx.scale, ctx.window, ctx.dtype, ctx.backward = scale, window, dtype, backward
        ctx.runs = runs
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, keys, values, kstart, pos, out = ctx.saved_tensors
        own = None if ctx.backward is None else ctx.backward(q, keys, values, kstart, pos, grad)
        dq, dk, dv = own or row_attention_backward(
            q, keys, values, kstart, pos, out, grad, ctx.scale, ctx.window, ctx.dtype, ctx.runs
        )
        return dq.reshape(q.shape), dk, dv, None, None, None, None, None, None, None, None


def row_attention_backward(
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
    runs: PackedRuns | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute each key row's probabilities in torch and form the three gradients: the
    matmuls take ``dtype`` operands (bf16 where the forward's dots did) into fp32 results,
    the softmax and its gradient are fp32.

    Queries are grouped into runs of consecutive tokens with the same key row (``kstart``: a
    packed segment is one run); the runs, their ends and key lengths reach the host in one
    transfer per call (not one sync per segment). Runs are processed in order and write
    ``dk``/``dv`` slices of their own key row: deterministic, no atomics.
    """
    packed = runs if runs is not None else _packed_runs(q, keys, kstart, pos)
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


def _sdpa_backward(
    qp: Tensor, kp: Tensor, vp: Tensor, gp: Tensor, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The packed backward through torch's fused attention (flash / memory-efficient): the
    segments as a batch ``[S, heads, L, hd]`` (causal, so a query never sees its segment's end
    padding), forward recomputed and differentiated with ``dtype`` operands. Returns fp32
    ``dq [S, L, heads, hd]``, ``dk``/``dv [S, L, kv_heads, hd]``."""
    s, length, kv_heads, group, hd = qp.shape
    heads = kv_heads * group
    q4 = qp.reshape(s, length, heads, hd).transpose(1, 2).to(dtype).detach().requires_grad_()
    k4 = kp.transpose(1, 2).to(dtype).detach().requires_grad_()
    v4 = vp.transpose(1, 2).to(dtype).detach().requires_grad_()
    g4 = gp.reshape(s, length, heads, -1).transpose(1, 2).to(dtype)
    with torch.enable_grad():
        o = F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=group > 1
        )
    dq, dk, dv = torch.autograd.grad(o, (q4, k4, v4), g4)
    return dq.transpose(1, 2).float(), dk.transpose(1, 2).float(), dv.transpose(1, 2).float()


def _packed_runs(q: Tensor, keys: Tensor, kstart: Tensor, pos: Tensor) -> PackedRuns | None:
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
    return PackedRuns(seg, int(facts[2]), int(facts[3]))


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
    """``row_attention_backward`` for the packed training layout in a few batched ops: the
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
    if window is None and q.device.type in SDPA_BACKWARD_DEVICES:
        dq_p, dk_p, dv_p = _sdpa_backward(qp, kp, vp, gp, scale, dtype)
        return (
            unpadded(dq_p).reshape(t, heads, hd).to(q.dtype),
            unpadded(dk_p).to(keys.dtype),
            unpadded(dv_p).to(values.dtype),
        )
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
