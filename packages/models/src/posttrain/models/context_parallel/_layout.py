"""Which tokens of a packed batch each rank holds, and where each of them sits.

A packed batch is one stream of ``T`` tokens made of segments (sequences) given by their
lengths (or ``cu_seqlens``). A ``SequenceSharding`` says, for every rank of a group, the
global stream indices of the tokens it holds, in its local order. Everything else
(split, merge, masks, the relative-bias index, the halo plan) is derived from those indices,
so the layouts below differ only in how they fill them:

* ``CPLayout.CONTIGUOUS`` (context parallel): every segment is cut into ``cp`` equal chunks;
  rank ``r`` holds chunk ``r`` of every segment.
* ``CPLayout.ZIGZAG`` (context parallel, load-balanced for causal attention): every segment
  is cut into ``2 * cp`` equal chunks; rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``
  of every segment, so each rank gets one cheap early chunk and one costly late chunk.
* ``shard_for_sequence_parallel`` (Megatron-style SP under TP): the whole stream is cut
  into ``sp`` equal contiguous pieces, ignoring segment boundaries.

Cutting each segment separately (rather than the whole stream) is the packed ("THD")
convention: every rank gets the same number of tokens of every sequence, which balances the
quadratic attention work per sequence. It requires each segment's length to be a multiple
of ``cp`` (contiguous) or ``2 * cp`` (zigzag); ``padded_segment_lengths`` says how far to pad.
Positions are absolute: the global index drives the causal, window and relative-bias
arithmetic (within one segment, global differences equal in-sequence differences), the
segment id drives the segment mask, and ``position`` (index within its segment) drives RoPE.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.models.context_parallel._errors import (
    ContextParallelConfigError,
    SequenceLayoutError,
    ShardShapeError,
)


class CPLayout(enum.StrEnum):
    """How a context-parallel group cuts each segment."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"


@dataclass(frozen=True, slots=True, eq=False)
class TokenPositions:
    """Where tokens sit in the packed stream (all int64, one entry per token)."""

    global_index: Tensor
    """Index in the packed stream (0..T-1)."""
    segment_id: Tensor
    """Which segment (sequence) the token belongs to."""
    position: Tensor
    """Index within its segment (what RoPE and a decode cache see)."""


@dataclass(frozen=True, slots=True, eq=False)
class SequenceSharding:
    """Every rank's tokens of one packed stream; identical on all ranks (no communication)."""

    layout: str
    """``"contiguous"``, ``"zigzag"`` or ``"sequence-parallel"``."""
    segment_lengths: tuple[int, ...]
    owner_indices: tuple[Tensor, ...]
    """Rank ``r``'s tokens as global stream indices, in ``r``'s local order."""
    segment_ids: Tensor
    """``[T]`` segment of each global token."""
    segment_starts: Tensor
    """``[T]`` global index of the first token of each global token's segment."""

    @property
    def world_size(self) -> int:
        """Number of ranks the stream is split over."""
        return len(self.owner_indices)

    @property
    def total_tokens(self) -> int:
        """``T``, the packed stream's length."""
        return int(self.segment_ids.numel())

    def local_count(self, rank: int) -> int:
        """Number of tokens rank ``rank`` holds."""
        return int(self._owned(rank).numel())

    def positions(self, rank: int) -> TokenPositions:
        """Absolute positions of rank ``rank``'s tokens, in its local order."""
        return self._positions_of(self._owned(rank))

    def all_positions(self) -> TokenPositions:
        """Positions of the whole stream in global order (what gathered K/V rows are)."""
        return self._positions_of(torch.arange(self.total_tokens))

    def split(self, x: Tensor, rank: int, *, dim: int = 0, name: str = "x") -> Tensor:
        """Rank ``rank``'s rows of a full-stream tensor ``x`` (``x.shape[dim] == T``)."""
        if x.ndim == 0 or x.shape[dim] != self.total_tokens:
            raise ShardShapeError(
                f"{name} has shape {tuple(x.shape)}; dim {dim} must be the stream length "
                f"{self.total_tokens}"
            )
        return x.index_select(dim, self._owned(rank))

    def merge(self, pieces: Sequence[Tensor], *, dim: int = 0, name: str = "pieces") -> Tensor:
        """The full-stream tensor from every rank's local tensor (inverse of ``split``)."""
        if len(pieces) != self.world_size:
            raise ShardShapeError(
                f"{name} has {len(pieces)} tensors, one per rank of {self.world_size} expected"
            )
        for rank, piece in enumerate(pieces):
            if piece.ndim == 0 or piece.shape[dim] != self.local_count(rank):
                raise ShardShapeError(
                    f"{name}[{rank}] has shape {tuple(piece.shape)}; dim {dim} must be rank "
                    f"{rank}'s token count {self.local_count(rank)}"
                )
        stacked = torch.cat(list(pieces), dim)
        return stacked.index_select(dim, self.inverse_order())

    def rank_order(self) -> Tensor:
        """Global index of each row of the rank-ordered concatenation of all local tensors."""
        return torch.cat(self.owner_indices)

    def inverse_order(self) -> Tensor:
        """Row of the rank-ordered concatenation that holds each global token."""
        order = self.rank_order()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return inverse

    def owner_of(self) -> tuple[Tensor, Tensor]:
        """``(rank, local_row)`` of every global token, each ``[T]`` int64."""
        rank = torch.empty(self.total_tokens, dtype=torch.int64)
        row = torch.empty(self.total_tokens, dtype=torch.int64)
        for r, owned in enumerate(self.owner_indices):
            rank[owned] = r
            row[owned] = torch.arange(owned.numel())
        return rank, row

    def _owned(self, rank: int) -> Tensor:
        if not 0 <= rank < self.world_size:
            raise ContextParallelConfigError(
                f"rank {rank} is outside the sharding's {self.world_size} ranks"
            )
        return self.owner_indices[rank]

    def _positions_of(self, index: Tensor) -> TokenPositions:
        return TokenPositions(
            global_index=index,
            segment_id=self.segment_ids[index],
            position=index - self.segment_starts[index],
        )


def segment_lengths_from_cu_seqlens(cu_seqlens: Sequence[int] | Tensor) -> tuple[int, ...]:
    """Segment lengths from cumulative offsets ``[0, l0, l0 + l1, ...]``."""
    offsets = [
        int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)
    ]
    if len(offsets) < 2 or offsets[0] != 0:
        raise SequenceLayoutError(
            f"cu_seqlens must start at 0 and hold >= 2 offsets, got {offsets}"
        )
    lengths = tuple(b - a for a, b in itertools.pairwise(offsets))
    for i, length in enumerate(lengths):
        if length <= 0:
            raise SequenceLayoutError(f"cu_seqlens must increase; segment {i} has length {length}")
    return lengths


def padded_segment_lengths(
    segment_lengths: Sequence[int], cp_size: int, layout: CPLayout | str
) -> tuple[int, ...]:
    """Each length rounded up to the multiple the layout needs (pad tokens go at segment ends)."""
    multiple = _multiple(_check_size(cp_size, "cp_size"), _check_layout(layout))
    return tuple(-(-int(n) // multiple) * multiple for n in _check_lengths(segment_lengths))


def shard_for_context_parallel(
    segment_lengths: Sequence[int], cp_size: int, layout: CPLayout | str
) -> SequenceSharding:
    """Cut every segment over ``cp_size`` ranks with ``layout`` (see the module docstring)."""
    cp_size = _check_size(cp_size, "cp_size")
    layout = _check_layout(layout)
    lengths = _check_lengths(segment_lengths)
    multiple = _multiple(cp_size, layout)
    for i, n in enumerate(lengths):
        if n % multiple:
            raise SequenceLayoutError(
                f"segment {i} has length {n}, not a multiple of {multiple} as the {layout} "
                f"layout with cp_size={cp_size} needs; pad it (padded_segment_lengths)"
            )
    pieces: list[list[Tensor]] = [[] for _ in range(cp_size)]
    start = 0
    for n in lengths:
        chunk = n // multiple
        for rank in range(cp_size):
            mirror = 2 * cp_size - 1 - rank
            chunks = [rank] if multiple == cp_size else [rank, mirror]
            for c in chunks:
                pieces[rank].append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += n
    return _sharding(str(layout), lengths, [torch.cat(p) for p in pieces])


def shard_for_sequence_parallel(segment_lengths: Sequence[int], sp_size: int) -> SequenceSharding:
    """Cut the whole stream into ``sp_size`` equal contiguous pieces (Megatron SP under TP)."""
    sp_size = _check_size(sp_size, "sp_size")
    lengths = _check_lengths(segment_lengths)
    total = sum(lengths)
    if total % sp_size:
        raise SequenceLayoutError(
            f"the packed stream has {total} tokens, not a multiple of sp_size={sp_size}"
        )
    piece = total // sp_size
    owned = [torch.arange(r * piece, (r + 1) * piece) for r in range(sp_size)]
    return _sharding("sequence-parallel", lengths, owned)


def subdivide_for_sequence_parallel(sharding: SequenceSharding, sp_size: int) -> SequenceSharding:
    """CP x SP: cut each rank's tokens (in local order) into ``sp_size`` contiguous pieces.

    Rank ``cp_rank * sp_size + sp_rank`` of the result holds piece ``sp_rank`` of ``cp_rank``'s
    tokens, so a halo plan over a group ordered that way (CP-major, the TP/SP rank fastest)
    serves the convolutions that run sequence-parallel inside each CP rank's TP group.
    """
    sp_size = _check_size(sp_size, "sp_size")
    pieces: list[Tensor] = []
    for rank, owned in enumerate(sharding.owner_indices):
        if owned.numel() % sp_size:
            raise SequenceLayoutError(
                f"rank {rank} holds {owned.numel()} tokens, not a multiple of sp_size={sp_size}"
            )
        pieces.extend(owned.chunk(sp_size))
    return _sharding(f"{sharding.layout}+sp{sp_size}", sharding.segment_lengths, pieces)


def _sharding(layout: str, lengths: tuple[int, ...], owned: list[Tensor]) -> SequenceSharding:
    sizes = torch.tensor(lengths, dtype=torch.int64)
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    return SequenceSharding(
        layout=layout,
        segment_lengths=lengths,
        owner_indices=tuple(owned),
        segment_ids=segment_ids,
        segment_starts=starts[segment_ids],
    )


def _multiple(cp_size: int, layout: CPLayout) -> int:
    # One rank holds the whole segment in either layout, so nothing needs padding.
    return cp_size if layout is CPLayout.CONTIGUOUS or cp_size == 1 else 2 * cp_size


def _check_size(size: int, field: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ContextParallelConfigError(f"{field} must be a positive int, got {size!r}")
    return size


def _check_layout(layout: CPLayout | str) -> CPLayout:
    try:
        return CPLayout(layout)
    except ValueError:
        known = ", ".join(v.value for v in CPLayout)
        raise ContextParallelConfigError(f"layout must be one of {known}; got {layout!r}") from None


def _check_lengths(segment_lengths: Sequence[int]) -> tuple[int, ...]:
    lengths = tuple(segment_lengths)
    if not lengths:
        raise SequenceLayoutError("segment_lengths is empty; a packed stream needs >= 1 segment")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SequenceLayoutError(
                f"segment {i} has length {n!r}; lengths must be positive ints"
            )
    return lengths
