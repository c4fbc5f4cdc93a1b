"""This rank's shard bound to an explicit process group, and the autograd-aware K/V gather.

``bind_shard(sharding, group)`` checks that the group matches the sharding (its size, and
that this process is a member) and returns the ``SequenceShard`` every other operation
takes; no function here ever falls back to the default group. A one-rank sharding may be
bound to ``group=None`` so a single process runs the same code with no collective.

``all_gather_sequence`` gathers every rank's rows of a tensor (K or V) into the full stream in
global order. Its backward sends each rank the gradient of the rows it owns and sums the
contributions of all ranks, so queries on other ranks train this rank's K/V projections and
the convolutions before them. A plain ``dist.all_gather`` is not differentiable: its output
carries no graph, so those contributions are silently dropped (the negative control in the
tests shows the gradients then differ from the single-process model).

Departure from ``torch.distributed.nn.functional.all_gather`` (same idea): that module is
deprecated in torch 2.13 in favour of a private one, so we wrap the public collectives. The
backward is an all-to-all followed by a sum over source ranks in rank order (a reduce-scatter
with a fixed summation order, so the gradient bits do not depend on the backend's algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx

from posttrain.models.context_parallel._errors import (
    ProcessGroupMismatchError,
    ShardShapeError,
)
from posttrain.models.context_parallel._layout import SequenceSharding, TokenPositions


@dataclass(frozen=True, slots=True, eq=False)
class SequenceShard:
    """One rank's view of a ``SequenceSharding`` together with the group it is split over."""

    sharding: SequenceSharding
    group: dist.ProcessGroup | None
    rank: int
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self.sharding.world_size

    @property
    def local_count(self) -> int:
        """Tokens this rank holds."""
        return self.sharding.local_count(self.rank)

    @property
    def positions(self) -> TokenPositions:
        """Absolute positions of this rank's tokens (cached)."""
        if "positions" not in self._cache:
            self._cache["positions"] = self.sharding.positions(self.rank)
        positions: TokenPositions = self._cache["positions"]
        return positions

    @property
    def stream_positions(self) -> TokenPositions:
        """Positions of the whole stream in global order: the rows of gathered K/V (cached)."""
        if "stream_positions" not in self._cache:
            self._cache["stream_positions"] = self.sharding.all_positions()
        positions: TokenPositions = self._cache["stream_positions"]
        return positions

    def split(self, x: Tensor, *, dim: int = 0, name: str = "x") -> Tensor:
        """This rank's rows of a full-stream tensor."""
        return self.sharding.split(x, self.rank, dim=dim, name=name)

    def check_local(self, x: Tensor, name: str) -> None:
        """Raise ``ShardShapeError`` unless ``x``'s first dim is this rank's token count."""
        if x.ndim == 0 or x.shape[0] != self.local_count:
            raise ShardShapeError(
                f"{name} has shape {tuple(x.shape)}; its first dim must be rank {self.rank}'s "
                f"token count {self.local_count} ({self.sharding.layout} layout)"
            )


def bind_shard(sharding: SequenceSharding, group: dist.ProcessGroup | None) -> SequenceShard:
    """This process's shard of ``sharding`` over ``group`` (``None`` only for one rank)."""
    if group is None:
        if sharding.world_size != 1:
            raise ProcessGroupMismatchError(
                f"the sharding splits the stream over {sharding.world_size} ranks but no "
                "process group was given (the default group is never used implicitly)"
            )
        return SequenceShard(sharding=sharding, group=None, rank=0)
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ProcessGroupMismatchError(
            f"global rank {dist.get_rank()} is not a member of the process group it was given"
        )
    if size != sharding.world_size:
        raise ProcessGroupMismatchError(
            f"the process group has {size} ranks but the sharding ({sharding.layout}) splits the "
            f"stream over {sharding.world_size}"
        )
    return SequenceShard(sharding=sharding, group=group, rank=rank)


def all_gather_sequence(x_local: Tensor, shard: SequenceShard, *, name: str = "x") -> Tensor:
    """The full stream ``[T, ...]`` in global order from every rank's ``x_local`` (autograd)."""
    shard.check_local(x_local, name)
    if shard.group is None:
        return x_local
    counts = {shard.sharding.local_count(r) for r in range(shard.world_size)}
    if len(counts) != 1:
        raise ShardShapeError(
            f"all_gather_sequence needs equal token counts on every rank, got {sorted(counts)}"
        )
    gathered: Tensor = _GatherRows.apply(x_local, shard.group, shard.world_size)  # type: ignore[no-untyped-call]
    inverse = shard._cache.get("inverse_order")
    if inverse is None:
        inverse = shard._cache["inverse_order"] = shard.sharding.inverse_order()
    return gathered.index_select(0, inverse.to(gathered.device))


class _GatherRows(torch.autograd.Function):
    """all_gather along dim 0 (rank order); backward: fixed-order reduce-scatter."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: dist.ProcessGroup, world: int) -> Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        ctx.world = world  # type: ignore[attr-defined]
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        world: int = ctx.world  # type: ignore[attr-defined]
        received = torch.empty_like(grad, memory_format=torch.contiguous_format)
        # Slice r of every rank's gradient goes to rank r; this rank receives its own rows'
        # gradient from each rank, stacked by source rank, and sums them in rank order.
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)  # type: ignore[attr-defined]
        parts = received.view(world, -1, *grad.shape[1:])
        total = parts[0].clone()
        for r in range(1, world):
            total = total + parts[r]
        return total, None, None
