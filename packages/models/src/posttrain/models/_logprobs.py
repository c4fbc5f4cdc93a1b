"""Token logprobs and entropies from the last hidden states without full-vocabulary logits.

``chunked_token_logprobs(h, weight, targets)`` gives, for each row ``i`` of ``h[N, H]``, the
log-softmax of ``logits = h @ weight.T`` (fp32) at ``targets[i]`` and the entropy of that
row's distribution. It walks the rows in chunks: only ``[chunk, vocab]`` fp32 logits exist at
a time, in the forward and again in the backward (which recomputes them from the saved ``h``
and ``weight`` instead of keeping ``N x vocab`` activations). The values are those of the
unchunked fp32 computation up to fp32 rounding (``logsumexp`` per row; the gradient is
``(onehot - p)`` for the logprob and ``-p * (log p + H)`` for the entropy).

The matmuls run in ``compute_dtype`` (bf16 under mixed precision: bf16 operands, the logits
then taken to fp32, as ``Bf16FastOps.linear`` followed by ``.float()`` does); everything after
the matmul is fp32. Fast numerics only: strict numerics keep their own kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK_TOKENS = 1024
"""Rows per chunk: 1024 rows of a 152k vocabulary are 0.6 GB of fp32 logits."""


def _chunk_logits(h: Tensor, weight: Tensor, dtype: torch.dtype, divisor: float) -> Tensor:
    z = F.linear(h.to(dtype), weight.to(dtype)).float()
    return z / divisor if divisor != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        chunk: int,
        dtype: torch.dtype,
        divisor: float,
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # an output left out of the loss gets no gradient
        lps, ents = [], []
        for i in range(0, h.shape[0], chunk):
            z = _chunk_logits(h[i : i + chunk], weight, dtype, divisor)
            logp = torch.log_softmax(z, dim=-1)
            lps.append(logp.gather(1, targets[i : i + chunk, None])[:, 0])
            ents.append(-(logp.exp() * logp).sum(-1))
        ctx.save_for_backward(h, weight, targets)
        ctx.chunk, ctx.dtype, ctx.divisor = chunk, dtype, divisor
        empty = h.new_zeros(0, dtype=torch.float32)
        return (torch.cat(lps) if lps else empty), (torch.cat(ents) if ents else empty)

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None) -> tuple[Any, ...]:
        h, weight, targets = ctx.saved_tensors
        chunk, dtype, divisor = ctx.chunk, ctx.dtype, ctx.divisor
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for i in range(0, h.shape[0], chunk):
            hc = h[i : i + chunk]
            logp = torch.log_softmax(_chunk_logits(hc, weight, dtype, divisor), dim=-1)
            p = logp.exp()
            gz = torch.zeros_like(logp)
            if g_lp is not None:
                g = g_lp[i : i + chunk, None]
                gz = gz - p * g
                gz = gz.scatter_add(1, targets[i : i + chunk, None], g)
            if g_ent is not None:
                ent = -(p * logp).sum(-1, keepdim=True)
                gz = gz - g_ent[i : i + chunk, None] * p * (logp + ent)
            if divisor != 1.0:
                gz = gz / divisor
            if grad_h is not None:
                grad_h[i : i + chunk] = (gz.to(dtype) @ weight.to(dtype)).to(h.dtype)
            if grad_w is not None:
                grad_w += (gz.t().to(dtype) @ hc.to(dtype)).float()
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_dtype: torch.dtype = torch.float32,
    logits_divisor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(logprob [N], entropy [N])`` fp32 of ``targets`` under ``log_softmax(h @ weight.T /
    logits_divisor)`` row by row (see the module doc); differentiable in ``h`` and ``weight``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if h.dim() != 2 or targets.shape != (h.shape[0],):
        raise ValueError(
            f"h must be [N, H] and targets [N]; got {list(h.shape)} and {list(targets.shape)}"
        )
    out: tuple[Tensor, Tensor] = _ChunkedLogprobs.apply(  # type: ignore[no-untyped-call]
        h, weight, targets.long(), chunk_tokens, compute_dtype, logits_divisor
    )
    return out
