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

The first two are lora-core's ``gather_from_seq`` / ``scatter_to_seq``
(``posttrain.lora.comm``), under the names this backend reads best with.

``split_tokens`` / ``gather_tokens_keep_grad`` serve values every rank computes identically
(the embedding before the layers, the head and loss after them), so their gradient is already
complete on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from posttrain.lora import gather_from_seq as gather_tokens
from posttrain.lora import gather_rows, group_rank, group_size
from posttrain.lora import scatter_to_seq as reduce_scatter_tokens

__all__ = ["gather_tokens", "gather_tokens_keep_grad", "reduce_scatter_tokens", "split_tokens"]


def _slice(x: Tensor, group: ProcessGroup) -> Tensor:
    return x.chunk(group_size(group), dim=0)[group_rank(group)].contiguous()


class _GatherKeepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _slice(grad, ctx.group), None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _slice(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return gather_rows(grad, ctx.group), None


def gather_tokens_keep_grad(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather along dim 0; backward keeps this rank's slice of the (replicated) grad."""
    if group_size(group) == 1:
        return x
    out: Tensor = _GatherKeepGrad.apply(x, group)  # type: ignore[no-untyped-call]
    return out


def split_tokens(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice along dim 0; backward all-gathers."""
    if group_size(group) == 1:
        return x
    out: Tensor = _Split.apply(x, group)  # type: ignore[no-untyped-call]
    return out
