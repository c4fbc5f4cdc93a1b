"""Halo exchange for causal depthwise ("short") convolutions over a split sequence.

A causal depthwise convolution of kernel ``k`` needs, for each token, the ``k - 1`` tokens
before it in the same segment. Under context or sequence parallelism most of them are local;
only the first ``k - 1`` tokens of each chunk miss predecessors, held by the rank with the
previous chunk (for zigzag, the neighbour of each of the two chunks; the two middle chunks
of a segment sit on one rank and need no exchange). ``plan_halo`` works out, from the
sharding alone, exactly which rows each rank sends to which: a halo never crosses a segment
boundary (the first chunk of a segment gets zeros, as the full-sequence convolution does),
and a chunk shorter than ``k - 1`` draws its halo from several ranks. One plan serves every
convolution site of a forward with the same kernel size.

``exchange_halo`` moves those rows with one ``all_to_all_single`` over the shard's group;
its backward sends each halo row's gradient back to the rank that owns the row and adds it
there. So the exchange moves ``(k - 1) x channels`` values per chunk boundary per site,
against ``(T - T / world) x channels`` per rank for gathering the sequence.
``causal_depthwise_conv(x_local, halo, weight, plan)`` then equals the full-sequence
convolution on the local rows, and ``residual_short_conv`` adds the residual;
``halo_windows`` gives the per-token taps for a model that sums them with its own kernel.

Weights follow ``torch.nn.Conv1d(C, C, k, groups=C)`` with ``k - 1`` zeros of left padding:
``weight[c, j]`` multiplies the input ``k - 1 - j`` tokens back (``j = k - 1`` is the token
itself); ``[C, 1, k]`` and ``[C, k]`` are both accepted. Taps are summed in fixed order in
fp32. Under TP + SP, bind a ``shard_for_sequence_parallel`` sharding to the TP group; the K/V
sites need no halo there (TP splits their channels, not the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx

from posttrain.models.context_parallel._errors import (
    ContextParallelConfigError,
    ShardShapeError,
)
from posttrain.models.context_parallel._gather import SequenceShard


@dataclass(frozen=True, slots=True, eq=False)
class HaloPlan:
    """What this rank sends and receives for one kernel size, and where each tap reads."""

    shard: SequenceShard
    kernel_size: int
    send_rows: Tensor
    """Local rows to send, grouped by destination rank (in rank order)."""
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    halo_global_index: Tensor
    """Global index of each received halo row (grouped by source rank, then stream order)."""
    tap_index: Tensor
    """``[n_local, k - 1]`` row of ``cat([x_local, halo, zero_row])`` read by tap ``j``."""

    @property
    def sent_rows(self) -> int:
        """Rows this rank sends per site."""
        return sum(self.send_counts)

    @property
    def received_rows(self) -> int:
        """Rows this rank receives per site (the halo's length)."""
        return sum(self.recv_counts)


def plan_halo(shard: SequenceShard, kernel_size: int) -> HaloPlan:
    """The halo plan of ``shard`` for a causal depthwise kernel of ``kernel_size`` (cached)."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
        raise ContextParallelConfigError(f"kernel_size must be a positive int, got {kernel_size!r}")
    key = f"halo{kernel_size}"
    cached = shard._cache.get(key)
    if isinstance(cached, HaloPlan):
        return cached
    sharding = shard.sharding
    owner_rank, owner_row = sharding.owner_of()
    needs = [_external_needs(shard, r, kernel_size, owner_rank) for r in range(shard.world_size)]
    me = shard.rank
    halo = needs[me]
    recv_counts = tuple(int((owner_rank[halo] == r).sum()) for r in range(shard.world_size))
    sends = [needs[r][owner_rank[needs[r]] == me] for r in range(shard.world_size)]
    send_rows = owner_row[torch.cat(sends)] if sends else torch.zeros(0, dtype=torch.int64)
    plan = HaloPlan(
        shard=shard,
        kernel_size=kernel_size,
        send_rows=send_rows,
        send_counts=tuple(int(s.numel()) for s in sends),
        recv_counts=recv_counts,
        halo_global_index=halo,
        tap_index=_tap_index(shard, kernel_size, halo),
    )
    shard._cache[key] = plan
    return plan


def exchange_halo(x_local: Tensor, plan: HaloPlan, *, name: str = "x") -> Tensor:
    """The ``[received_rows, ...]`` halo rows of ``x_local`` from other ranks (autograd)."""
    plan.shard.check_local(x_local, name)
    group = plan.shard.group
    if group is None:
        return x_local.new_zeros((0, *x_local.shape[1:]))
    halo: Tensor = _ExchangeRows.apply(  # type: ignore[no-untyped-call]
        x_local,
        plan.send_rows.to(x_local.device),
        list(plan.send_counts),
        list(plan.recv_counts),
        group,
    )
    return halo


def halo_windows(x_local: Tensor, halo: Tensor, plan: HaloPlan) -> Tensor:
    """``[k, n_local, ...]``: tap ``i`` of each local token is the input ``k - 1 - i`` tokens back.

    Oldest tap first, the token itself last; 0 where that token is outside the sequence. This
    is the ``windows`` argument of the model's ``ops.sconv`` (strict: a fixed-order tree over
    the taps), so a model layout gets its own kernel's bits: ``ops.sconv(halo_windows(...), w)``.
    """
    plan.shard.check_local(x_local, "x_local")
    if halo.shape != (plan.received_rows, *x_local.shape[1:]):
        raise ShardShapeError(
            f"halo has shape {tuple(halo.shape)}; the plan expects "
            f"{(plan.received_rows, *x_local.shape[1:])}"
        )
    extended = torch.cat(
        [x_local, halo.to(x_local.dtype), x_local.new_zeros((1, *x_local.shape[1:]))]
    )
    tap_index = plan.tap_index.to(x_local.device)
    taps = [extended.index_select(0, tap_index[:, j]) for j in range(plan.kernel_size - 1)]
    return torch.stack([*taps, x_local])


def causal_depthwise_conv(x_local: Tensor, halo: Tensor, weight: Tensor, plan: HaloPlan) -> Tensor:
    """The full-sequence causal depthwise convolution, on this rank's rows (fp32)."""
    plan.shard.check_local(x_local, "x_local")
    taps = _check_weight(weight, x_local, plan.kernel_size)
    windows = halo_windows(x_local.float(), halo, plan)
    out = windows[0] * taps[..., 0]
    for j in range(1, plan.kernel_size):
        out = out + windows[j] * taps[..., j]
    return out


def residual_short_conv(x_local: Tensor, weight: Tensor, plan: HaloPlan) -> Tensor:
    """``x + conv(x)``: the residual short convolution of ``x_local`` with its halo (fp32)."""
    halo = exchange_halo(x_local, plan, name="x_local")
    return x_local.float() + causal_depthwise_conv(x_local, halo, weight, plan)


def _check_weight(weight: Tensor, x_local: Tensor, kernel_size: int) -> Tensor:
    taps = weight.squeeze(1) if weight.ndim == 3 and weight.shape[1] == 1 else weight
    channels = x_local.shape[1:]
    if taps.ndim < 2 or taps.shape != (*channels, kernel_size):
        raise ShardShapeError(
            f"conv weight has shape {tuple(weight.shape)}; expected {(*channels, kernel_size)} "
            f"(or [C, 1, k]) for input channels {tuple(channels)} and kernel {kernel_size}"
        )
    return taps.float()


def _external_needs(shard: SequenceShard, rank: int, k: int, owner_rank: Tensor) -> Tensor:
    """Global indices ``rank`` reads but does not hold, ordered by (owner rank, index)."""
    sharding = shard.sharding
    owned = sharding.owner_indices[rank]
    candidates, valid = _candidates(sharding.segment_starts, owned, k)
    external = valid & (owner_rank[candidates] != rank)
    needed: Tensor = torch.unique(candidates[external])
    order = torch.argsort(owner_rank[needed] * sharding.total_tokens + needed)
    return needed[order]


def _candidates(segment_starts: Tensor, owned: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``[n, k - 1]`` global index read by tap ``j`` of each owned token, and its validity."""
    back = torch.arange(k - 1, 0, -1)
    wanted = owned[:, None] - back[None, :]
    valid = wanted >= segment_starts[owned][:, None]
    return wanted.clamp(min=0), valid


def _tap_index(shard: SequenceShard, k: int, halo: Tensor) -> Tensor:
    owned = shard.sharding.owner_indices[shard.rank]
    n, h = owned.numel(), halo.numel()
    row_of = torch.full((shard.sharding.total_tokens,), n + h, dtype=torch.int64)
    row_of[owned] = torch.arange(n)
    row_of[halo] = torch.arange(n, n + h)
    candidates, valid = _candidates(shard.sharding.segment_starts, owned, k)
    return torch.where(valid, row_of[candidates], n + h)


class _ExchangeRows(torch.autograd.Function):
    """Send chosen local rows to other ranks; backward returns their gradients and adds them."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        send_rows: Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        group: dist.ProcessGroup,
    ) -> Tensor:
        ctx.save_for_backward(send_rows)
        ctx.meta = (x.shape, send_counts, recv_counts, group)  # type: ignore[attr-defined]
        outgoing = x.index_select(0, send_rows).contiguous()
        incoming = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(incoming, outgoing, recv_counts, send_counts, group=group)
        return incoming

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        (send_rows,) = ctx.saved_tensors  # type: ignore[attr-defined]
        shape, send_counts, recv_counts, group = ctx.meta  # type: ignore[attr-defined]
        returned = grad.new_empty((sum(send_counts), *shape[1:]))
        dist.all_to_all_single(returned, grad.contiguous(), send_counts, recv_counts, group=group)
        grad_x = grad.new_zeros(shape).index_add_(0, send_rows, returned)
        return grad_x, None, None, None, None
