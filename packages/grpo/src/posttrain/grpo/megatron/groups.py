"""The process groups of the megatron backend, built from the world size and the parallel sizes.

One validated object, ``ParallelGroups``, holds every group a rank needs; nothing reads
megatron-core's global ``parallel_state``. Rank layout (Megatron's default order, tensor
parallel fastest), for ``world = tp x dp`` on the dense side and ``world = ep x expert_dp``
on the expert side (expert tensor parallel is 1)::

    tp group        ranks {d*tp, ..., d*tp + tp - 1}        (consecutive)
    dp group        ranks {t, t + tp, t + 2*tp, ...}        (same tp rank)
    ep group        ranks {e*ep, ..., e*ep + ep - 1}        (consecutive)
    expert_dp group ranks {j, j + ep, j + 2*ep, ...}        (same ep rank)

The ranks of one tp group see the same samples (the data-parallel share is by ``dp_rank``).
``dist.new_group`` is collective over the world, so every rank creates every group and keeps
its own; a size-1 axis gets ``None`` (no collective runs on it), except ``tp``: megatron-core's
parallel linears need a group object even when it holds one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from posttrain.grpo._errors import GrpoConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    """This rank's place in the (tensor, data) and (expert, expert-data) splits of the world."""

    world_size: int
    rank: int
    tp_size: int
    ep_size: int
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    expert_dp: dist.ProcessGroup | None

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def expert_dp_rank(self) -> int:
        return self.rank // self.ep_size


def check_parallel_sizes(world_size: int, tp_size: int, ep_size: int) -> None:
    """Refuse sizes that do not split ``world_size`` (before any group exists), naming the field."""
    for name, value in (
        ("tensor_model_parallel_size", tp_size),
        ("expert_model_parallel_size", ep_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GrpoConfigError(f"{name} must be an int >= 1, got {value!r}", field=name)
        if world_size % value:
            raise GrpoConfigError(
                f"{name}={value} does not divide the {world_size} trainer ranks", field=name
            )


def build_parallel_groups(tp_size: int, ep_size: int = 1) -> ParallelGroups:
    """Create the groups of the module docstring over the initialised world; collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_parallel_sizes(world, tp_size, ep_size)

    def blocks(size: int, *, always: bool = False) -> dist.ProcessGroup | None:
        if size == 1 and not always:
            return None
        mine = None
        for start in range(0, world, size):
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = group
        return mine

    def strided(stride: int) -> dist.ProcessGroup | None:
        if world // stride == 1:
            return None
        mine = None
        for offset in range(stride):
            group = dist.new_group(list(range(offset, world, stride)))
            if rank % stride == offset:
                mine = group
        return mine

    tp_group = blocks(tp_size, always=True)
    assert tp_group is not None
    return ParallelGroups(
        world_size=world,
        rank=rank,
        tp_size=tp_size,
        ep_size=ep_size,
        tp=tp_group,  # megatron-core's layers need a group, even of 1
        dp=strided(tp_size),
        ep=blocks(ep_size),
        expert_dp=strided(ep_size),
    )
