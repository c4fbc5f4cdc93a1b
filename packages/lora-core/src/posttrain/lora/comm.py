"""Autograd-aware collectives along dim 0 (the token / sequence dim), with explicit groups.

Four conjugate pairs, the same ones Megatron uses at hidden width; LoRA uses them at width r:

=========================  =========================  ==========================
op                         forward                    backward
=========================  =========================  ==========================
``copy_to_group``          identity                   all-reduce SUM
``reduce_from_group``      all-reduce SUM             identity
``gather_from_seq``        all-gather along dim 0     reduce-scatter along dim 0
``scatter_to_seq``         reduce-scatter along dim 0 all-gather along dim 0
=========================  =========================  ==========================

Collectives are called through the ``torch.distributed`` module attributes so a benchmark can wrap
them to count bytes. A ``None`` group or a group of size 1 makes every op the identity.

Public for the other packages that shard tensors over explicit groups on any device (grpo's
megatron backend): ``group_size`` / ``group_rank``, ``all_gather_flat`` /
``reduce_scatter_flat`` and the autograd pairs above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; 1 for ``None`` (no parallelism on that axis)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup | None) -> None:
    """All-gather ``x`` into ``out`` along dim 0 (``all_gather_single`` where torch has it;
    torch 2.13 deprecates ``all_gather_into_tensor``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    """Reduce-scatter (SUM) ``x`` into ``out`` along dim 0 (``reduce_scatter_single`` where
    torch has it)."""
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(out, x, op=dist.ReduceOp.SUM, group=group)
    else:
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def gather_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather ``x`` along dim 0 into a new tensor like it (no autograd)."""
    n = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group)
    return out


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter: dim 0 of size {x.shape[0]} not divisible by {n}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x, group)
    return out


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group), None


class _ScatterToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_rows(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity forward, all-reduce SUM backward (input of a column-parallel op)."""
    if group_size(group) == 1:
        return x
    out: torch.Tensor = _CopyToGroup.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce SUM forward, identity backward (output of a row-parallel op)."""
    if group_size(group) == 1:
        return x
    out: torch.Tensor = _ReduceFromGroup.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def gather_from_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather along dim 0 forward, reduce-scatter backward (SP input of a column op)."""
    if group_size(group) == 1:
        return x
    out: torch.Tensor = _GatherFromSeq.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def scatter_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward, all-gather backward (SP output of a row op)."""
    if group_size(group) == 1:
        return x
    out: torch.Tensor = _ScatterToSeq.apply(x, group)  # type: ignore[no-untyped-call]
    return out
