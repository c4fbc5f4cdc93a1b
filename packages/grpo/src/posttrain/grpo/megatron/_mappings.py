"""Autograd collectives along the token dim (dim 0) for sequence parallelism, any device.

megatron-core has the same four (``tensor_parallel.mappings``), but its all-gather and
reduce-scatter allocate their output on ``torch.cuda.current_device()``, so they cannot run on
a CPU/gloo rank. These allocate like their input and take the group explicitly.

=============================  ======================  =========================
op                             forward                 backward
=============================  ======================  =========================
``gather_tokens``              all-gather              reduce-scatter (SUM)
``reduce_scatter_tokens``      reduce-scatter (SUM)    all-gather
``split_tokens``               keep this rank's slice  all-gather
``gather_tokens_keep_grad``    all-gather              keep this rank's slice
=============================  ======================  =========================

``split_tokens`` / ``gather_tokens_keep_grad`` serve values every rank computes identically
(the embedding before the layers, the head and loss after them), so their gradient is already
complete on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def _all_gather(x: Tensor, group: ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)
    return out


def _reduce_scatter(x: Tensor, group: ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(out, x, op=dist.ReduceOp.SUM, group=group)
    else:
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


def _slice(x: Tensor, group: ProcessGroup) -> Tensor:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=0)[rank].contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, keep_grad: bool) -> Tensor:
        ctx.group, ctx.keep_grad = group, keep_grad
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.keep_grad:
            return _slice(grad, ctx.group), None, None
        return _reduce_scatter(grad, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_gather(grad, ctx.group), None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_gather(grad, ctx.group), None


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def gather_tokens(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather along dim 0; backward reduce-scatters (SUM)."""
    if _size(group) == 1:
        return x
    out: Tensor = _Gather.apply(x, group, False)  # type: ignore[no-untyped-call]
    return out


def gather_tokens_keep_grad(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather along dim 0; backward keeps this rank's slice of the (replicated) grad."""
    if _size(group) == 1:
        return x
    out: Tensor = _Gather.apply(x, group, True)  # type: ignore[no-untyped-call]
    return out


def reduce_scatter_tokens(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Reduce-scatter (SUM) along dim 0; backward all-gathers."""
    if _size(group) == 1:
        return x
    out: Tensor = _ReduceScatter.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def split_tokens(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice along dim 0; backward all-gathers."""
    if _size(group) == 1:
        return x
    out: Tensor = _Split.apply(x, group)  # type: ignore[no-untyped-call]
    return out
