"""Where a MoE layer's (token, slot) pairs sit when grouped by expert in padded groups.

Grouped expert kernels (``torch._grouped_mm`` in fast numerics, the strict Triton
``grouped_linear``) read the pairs as one buffer of rows: expert 0's pairs, then expert 1's,
each group padded with zero rows to a multiple of ``align``. The buffer has a static number of
rows (``align`` times ``min(pairs, min(experts, pairs) + ceil(pairs / align))`` tiles, a bound
on any routing's tiles), so nothing here waits on the device: no host sync, whatever the
routing. A decode step of a few tokens over many experts gets a few tiles, not one per expert.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class ExpertRows(NamedTuple):
    """The padded layout of ``ids[T, k]``'s pairs (pair ``p`` is token ``p // k``, slot
    ``p % k``)."""

    order: Tensor
    """``[P]`` the pairs sorted by expert (stable: row-major order within an expert)."""
    dest: Tensor
    """``[P]`` the padded row of sorted pair ``i`` (``order[i]``)."""
    row_of_pair: Tensor
    """``[P]`` the padded row of pair ``p``."""
    ends: Tensor
    """``[E]`` int64: one past each expert's last padded row (a multiple of ``align``)."""
    rows: int
    """The buffer's rows: a multiple of ``align``, at least ``ends[-1]``."""


def expert_rows(ids: Tensor, num_experts: int, align: int) -> ExpertRows:
    """The padded layout of the pairs of ``ids[T, k]`` over ``num_experts`` experts."""
    flat = ids.reshape(-1)
    pairs = flat.shape[0]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    starts = ends - padded
    first = counts.cumsum(0) - counts  # each expert's first sorted pair
    expert = flat[order]
    dest = starts[expert] + torch.arange(pairs, device=flat.device) - first[expert]
    row_of_pair = torch.empty_like(dest).index_copy(0, order, dest)
    # whole tiles: each group takes ceil(count / align) of them, so at most one part-filled
    # tile per expert holding pairs, and never more tiles than pairs
    tiles = min(pairs, min(num_experts, pairs) + -(-pairs // align))
    return ExpertRows(order, dest, row_of_pair, ends, tiles * align)


def tile_experts(layout: ExpertRows, align: int) -> Tensor:
    """int32 ``[rows // align]``: the expert of each tile of ``align`` rows, -1 past the last
    group (tiles of zero rows)."""
    tiles = torch.arange(layout.rows // align, device=layout.ends.device)
    expert = torch.searchsorted(layout.ends // align, tiles, right=True)
    return torch.where(expert < layout.ends.shape[0], expert, -1).to(torch.int32)


def source_rows(layout: ExpertRows, k: int) -> Tensor:
    """int64 ``[rows]``: the token each padded row reads (-1 for a pad row)."""
    src = torch.full((layout.rows,), -1, dtype=torch.long, device=layout.ends.device)
    pairs = torch.arange(layout.row_of_pair.shape[0], device=src.device)
    return src.index_copy_(0, layout.row_of_pair, pairs // k)


def pair_rows(layout: ExpertRows) -> Tensor:
    """int64 ``[rows]``: the pair each padded row holds (-1 for a pad row)."""
    dst = torch.full((layout.rows,), -1, dtype=torch.long, device=layout.ends.device)
    pairs = torch.arange(layout.row_of_pair.shape[0], device=dst.device)
    return dst.index_copy_(0, layout.row_of_pair, pairs)
