"""Context-parallel layouts, halo plans, masks and validation, in one process (no collectives)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import posttrain.models.context_parallel as cp
from posttrain.interface import PosttrainError
from posttrain.models import ModelConfigError, ModelsError
from posttrain.models.context_parallel import (
    ContextParallelConfigError,
    CPLayout,
    ProcessGroupMismatchError,
    SequenceLayoutError,
    ShardShapeError,
    attention_mask,
    bind_shard,
    plan_halo,
    residual_short_conv,
    segment_lengths_from_cu_seqlens,
    shard_for_context_parallel,
    shard_for_sequence_parallel,
)


def test_all_is_exactly_the_public_surface_and_errors_root_in_models() -> None:
    public = {n for n in dir(cp) if not n.startswith("_")}
    assert public == set(cp.__all__)
    assert issubclass(ContextParallelConfigError, ModelConfigError)
    for error in (SequenceLayoutError, ShardShapeError, ProcessGroupMismatchError):
        assert issubclass(error, ModelsError)
        assert issubclass(error, PosttrainError)


def test_zigzag_gives_rank_r_chunks_r_and_mirror_of_every_segment() -> None:
    sharding = shard_for_context_parallel([8, 4], 2, CPLayout.ZIGZAG)
    # segment 0: chunks of 2 -> rank 0: [0,1] + [6,7]; segment 1 (start 8): chunks of 1
    assert sharding.owner_indices[0].tolist() == [0, 1, 6, 7, 8, 11]
    assert sharding.owner_indices[1].tolist() == [2, 3, 4, 5, 9, 10]
    positions = sharding.positions(1)
    assert positions.segment_id.tolist() == [0, 0, 0, 0, 1, 1]
    assert positions.position.tolist() == [2, 3, 4, 5, 1, 2]


def test_contiguous_cuts_every_segment_and_sp_cuts_the_stream() -> None:
    sharding = shard_for_context_parallel([4, 6], 2, "contiguous")
    assert sharding.owner_indices[0].tolist() == [0, 1, 4, 5, 6]
    sp = shard_for_sequence_parallel([3, 5], 2)
    assert sp.owner_indices[1].tolist() == [4, 5, 6, 7]
    assert sp.positions(1).position.tolist() == [1, 2, 3, 4]


def test_cp_x_sp_subdivides_each_rank_in_local_order() -> None:
    sharding = shard_for_context_parallel([8], 2, CPLayout.ZIGZAG)  # rank 0: [0,1,6,7]
    both = cp.subdivide_for_sequence_parallel(sharding, 2)
    assert [t.tolist() for t in both.owner_indices] == [[0, 1], [6, 7], [2, 3], [4, 5]]
    with pytest.raises(SequenceLayoutError, match="sp_size=3"):
        cp.subdivide_for_sequence_parallel(sharding, 3)


@pytest.mark.parametrize("layout", list(CPLayout))
def test_split_then_merge_is_the_identity(layout: CPLayout) -> None:
    sharding = shard_for_context_parallel([8, 16, 8], 4, layout)
    x = torch.randn(32, 3)
    pieces = [sharding.split(x, r) for r in range(4)]
    assert torch.equal(sharding.merge(pieces), x)
    assert sorted(torch.cat(sharding.owner_indices).tolist()) == list(range(32))


def test_halo_plan_moves_k_minus_1_rows_per_cross_rank_boundary() -> None:
    # zigzag CP=2, one segment of 16: chunks 0|1|2|3 on ranks 0,1,1,0. Boundaries 0->1 and
    # 2->3 cross ranks; 1->2 stays on rank 1. Kernel 4: 3 rows per crossing.
    sharding = shard_for_context_parallel([16], 2, CPLayout.ZIGZAG)
    plans = [_plan_for(sharding, rank, 4) for rank in range(2)]
    assert plans[0].send_counts == (0, 3)  # rank 0 sends chunk 0's tail to rank 1
    assert plans[1].send_counts == (3, 0)  # rank 1 sends chunk 2's tail to rank 0
    assert plans[0].halo_global_index.tolist() == [9, 10, 11]
    assert plans[1].halo_global_index.tolist() == [1, 2, 3]


def test_halo_never_crosses_a_segment_boundary() -> None:
    # SP over 2 ranks of segments [3, 5]: rank 1 starts at token 4 (segment 1, position 1),
    # so it needs only token 3 (segment 1's first token), not segment 0's tokens.
    sharding = shard_for_sequence_parallel([3, 5], 2)
    plan = _plan_for(sharding, 1, 4)
    assert plan.halo_global_index.tolist() == [3]


def _plan_for(sharding: cp.SequenceSharding, rank: int, kernel: int) -> cp.HaloPlan:
    # A plan is computed from the sharding alone; build one rank's view without a group.
    shard = cp.SequenceShard(sharding=sharding, group=None, rank=rank)
    return plan_halo(shard, kernel)


def test_one_rank_conv_equals_per_segment_conv1d() -> None:
    lengths = [5, 2, 9]
    shard = bind_shard(shard_for_context_parallel(lengths, 1, CPLayout.ZIGZAG), None)
    x = torch.randn(16, 3)
    w = torch.randn(3, 4)
    expected = []
    for seg in torch.split(x, lengths):
        padded = F.pad(seg.T[None], (3, 0))
        expected.append(seg + F.conv1d(padded, w[:, None, :], groups=3)[0].T)
    got = residual_short_conv(x, w[:, None, :], plan_halo(shard, 4))
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-6, atol=1e-6)


def test_halo_windows_hold_each_tokens_taps_oldest_first() -> None:
    shard = bind_shard(shard_for_context_parallel([3, 2], 1, "contiguous"), None)
    plan = plan_halo(shard, 3)
    x = torch.arange(1.0, 6.0)[:, None]  # tokens 1 2 3 | 4 5
    windows = cp.halo_windows(x, cp.exchange_halo(x, plan), plan)
    assert windows[..., 0].tolist() == [[0, 0, 1, 0, 0], [0, 1, 2, 0, 4], [1, 2, 3, 4, 5]]


def test_mask_is_segment_causal_and_windowed() -> None:
    positions = shard_for_context_parallel([3, 2], 1, "contiguous").all_positions()
    mask = attention_mask(positions, positions, window=2)
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_cu_seqlens_and_padding() -> None:
    assert segment_lengths_from_cu_seqlens(torch.tensor([0, 3, 10])) == (3, 7)
    assert cp.padded_segment_lengths([3, 7, 8], 2, "zigzag") == (4, 8, 8)
    with pytest.raises(SequenceLayoutError, match="segment 1"):
        segment_lengths_from_cu_seqlens([0, 3, 3])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: shard_for_context_parallel([8], 0, "zigzag"),
            ContextParallelConfigError,
            "cp_size",
        ),
        (lambda: shard_for_context_parallel([8], 2, "ring"), ContextParallelConfigError, "layout"),
        (lambda: shard_for_context_parallel([8, 6], 2, "zigzag"), SequenceLayoutError, "segment 1"),
        (lambda: shard_for_context_parallel([], 2, "zigzag"), SequenceLayoutError, "empty"),
        (lambda: shard_for_sequence_parallel([3, 4], 2), SequenceLayoutError, "sp_size=2"),
        (lambda: attention_mask(*_two_positions(), window=0), ContextParallelConfigError, "window"),
    ],
)
def test_bad_sizes_and_lengths_raise_named_errors(call, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        call()


def _two_positions() -> tuple[cp.TokenPositions, cp.TokenPositions]:
    positions = shard_for_context_parallel([4], 1, "zigzag").all_positions()
    return positions, positions


def test_shape_and_group_mismatches_raise_named_errors() -> None:
    sharding = shard_for_context_parallel([8], 2, "zigzag")
    with pytest.raises(ProcessGroupMismatchError, match="no process group"):
        bind_shard(sharding, None)
    one = bind_shard(shard_for_context_parallel([8], 1, "zigzag"), None)
    with pytest.raises(ShardShapeError, match="x_local"):
        residual_short_conv(torch.zeros(7, 2), torch.zeros(2, 4), plan_halo(one, 4))
    with pytest.raises(ShardShapeError, match="conv weight"):
        residual_short_conv(torch.zeros(8, 2), torch.zeros(3, 4), plan_halo(one, 4))
    with pytest.raises(ContextParallelConfigError, match="kernel_size"):
        plan_halo(one, 0)
    with pytest.raises(ContextParallelConfigError, match="scale"):
        cp.context_parallel_attention(
            torch.zeros(8, 2, 4),
            torch.zeros(8, 1, 4),
            torch.zeros(8, 1, 4),
            one,
            scale=float("nan"),
        )
    with pytest.raises(ShardShapeError, match="x"):
        sharding.split(torch.zeros(7, 2), 0)
