"""The collectives of expert parallelism, autograd-aware where gradients cross them.

=========================  ===================================  ==================================
op                         forward                              backward
=========================  ===================================  ==================================
``all_to_all_rows``        rows ``send[r]`` to rank ``r``       the reverse all-to-all
``take_token_share``       this TP rank's rows of replicated    all-gather of the row grads
                           tokens
``gather_token_shares``    all-gather of every rank's rows      this rank's rows of the grad
=========================  ===================================  ==================================

Every op takes an ``anchor``: a trainable parameter of the calling layer (or None). It makes
the output require grad on every rank whenever grad mode is on and the layer trains, so every
rank's autograd graph holds the op and runs its backward collective, even a rank whose own
rows are empty or do not depend on anything trainable (a rank that routed or received no
token). ``all_to_all_rows`` also takes a ``tie``: a tensor that gets an exact zero gradient,
so the backward of the op that produced it runs after this one's on every rank (the return
all-to-all of an expert layer is tied to the dispatch all-to-all's output).

``all_gather_bytes`` gathers tensors of any dtype as raw bytes: bitwise, whatever the backend
supports for the dtype. A ``None`` group is an axis of size 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from posttrain.lora import all_gather_flat, group_size


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertParallelGroups:
    """The groups of one rank; ``None`` is an axis of size 1 (never the world by default).

    ``ep``: experts split over it. ``expert_dp``: ranks holding the same experts. ``dp``: the
    dense data-parallel group (its size divides every grad, see the module doc). ``tp``: the
    tensor-parallel group; ``sequence_parallel`` says whether its ranks hold different tokens
    (True) or the same tokens (False: the layer splits them, see the module doc).
    """

    ep: ProcessGroup | None = None
    expert_dp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    tp: ProcessGroup | None = None
    sequence_parallel: bool = False


def all_reduce_scaled(grads: list[Tensor], group: ProcessGroup | None, scale: float) -> None:
    """SUM-reduce ``grads`` over ``group`` in one fp32 collective, times ``scale``, written back
    in place (no collective for a group of size 1; none at all when ``scale`` is 1 too)."""
    if not grads or (group_size(group) == 1 and scale == 1.0):
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    if group_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for g, piece in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def share_sizes(rows: int, parts: int) -> list[int]:
    """Contiguous shares of ``rows`` over ``parts`` ranks, the first ones one row longer."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


def _all_to_all(x: Tensor, send: list[int], recv: list[int], group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _all_gather_rows(x: Tensor, sizes: list[int], group: ProcessGroup) -> Tensor:
    """All-gather rows of varying count (``sizes[r]`` from rank ``r``) as one all-to-all."""
    n = len(sizes)
    return _all_to_all(torch.cat([x] * n), [x.shape[0]] * n, sizes, group)


def all_to_all_counts(counts: Tensor, group: ProcessGroup) -> Tensor:
    """Equal-split all-to-all of an int tensor (``counts[r * c : (r + 1) * c]`` to rank ``r``)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_gather_bytes(tensors: Sequence[Tensor], group: ProcessGroup) -> list[list[Tensor]]:
    """Every rank's ``tensors`` (same shapes and dtypes on every rank), bit for bit, by one
    all-gather of their bytes; ``out[r][j]`` is rank ``r``'s ``tensors[j]``."""
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    flat = torch.cat(raw)
    out = flat.new_empty((group_size(group) * flat.numel(),))
    all_gather_flat(out, flat, group)
    result = []
    for row in out.view(group_size(group), -1):
        pieces = torch.split(row, [r.numel() for r in raw])
        result.append(
            [p.clone().view(t.dtype).view(t.shape) for p, t in zip(pieces, tensors, strict=True)]
        )
    return result


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        send: list[int],
        recv: list[int],
        group: ProcessGroup,
        anchor: Tensor | None,
        tie: Tensor | None,
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.tie = None if tie is None else (tie.shape, tie.dtype, tie.device)
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = _all_to_all(grad, ctx.recv, ctx.send, ctx.group)
        tie = None
        if ctx.tie is not None and ctx.needs_input_grad[5]:
            shape, dtype, device = ctx.tie
            tie = torch.zeros(shape, dtype=dtype, device=device)
        return back, None, None, None, None, tie


class _TakeShare(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, sizes: list[int], group: ProcessGroup, anchor: Tensor | None
    ) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        start = sum(sizes[: dist.get_rank(group)])
        return x[start : start + sizes[dist.get_rank(group)]].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _all_gather_rows(grad, ctx.sizes, ctx.group), None, None, None


class _GatherShares(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, y: Tensor, sizes: list[int], group: ProcessGroup, anchor: Tensor | None
    ) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(y, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # the grad of a replicated activation is whole and equal on every TP rank
        start = sum(ctx.sizes[: dist.get_rank(ctx.group)])
        mine = grad[start : start + ctx.sizes[dist.get_rank(ctx.group)]].clone()
        return mine, None, None, None


def all_to_all_rows(
    x: Tensor,
    send: list[int],
    recv: list[int],
    group: ProcessGroup,
    *,
    anchor: Tensor | None,
    tie: Tensor | None = None,
) -> Tensor:
    """Rows ``x[sum(send[:r]) : sum(send[:r + 1])]`` to rank ``r``; returns the rows received,
    ordered by source rank. Backward: the reverse all-to-all."""
    out: Tensor = _AllToAll.apply(x, send, recv, group, anchor, tie)  # type: ignore[no-untyped-call]
    return out


def take_token_share(
    x: Tensor, sizes: list[int], group: ProcessGroup, *, anchor: Tensor | None
) -> Tensor:
    """This rank's contiguous rows (``sizes`` per rank) of tokens replicated over ``group``."""
    out: Tensor = _TakeShare.apply(x, sizes, group, anchor)  # type: ignore[no-untyped-call]
    return out


def gather_token_shares(
    y: Tensor, sizes: list[int], group: ProcessGroup, *, anchor: Tensor | None
) -> Tensor:
    """Every rank's rows (``sizes`` per rank) concatenated in rank order, on every rank."""
    out: Tensor = _GatherShares.apply(y, sizes, group, anchor)  # type: ignore[no-untyped-call]
    return out


def inverse_permutation(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
