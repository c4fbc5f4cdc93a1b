"""The weight-update process group, formed the way SGLang's ``init_weights_update_group`` forms it.

SGLang's engines join a ``torch.distributed`` group of their own (not the trainer's default
group): a ``tcp://master_address:master_port`` rendezvous, the store prefixed with the group's
name, then c10d's process-group helper with that name. ``join_update_group`` does exactly that on
either side, so the trainer (group rank 0, it hosts the store) and each engine's TP workers
(ranks ``rank_offset ...``) meet in one group; ``backend`` is nccl on GPU, gloo on CPU.

``UpdateGroup.broadcast`` sends (rank 0) or receives (any other rank, into the given tensors) a
bucket, one broadcast per tensor in order (on gloo, which lacks float8, as a uint8 view of the
same bytes), exactly what SGLang's receiver posts for each
``/update_weights_from_distributed`` request. The group is created once per run and
``destroy``-ed at the end (``/destroy_weights_update_group`` on the engines).

For nccl, c10d's private helper (``_new_process_group_helper``) builds the group, as SGLang
does. For gloo the group is built directly with the helper's store layout (the same keys, so an
engine that uses the helper meets it), unregistered: a trainer and an engine in one process (an
in-process test server) can then each hold an end of one group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.rendezvous import rendezvous

from posttrain.formats._errors import UpdateGroupError

__all__ = ["UpdateGroup", "join_update_group"]


@dataclass(slots=True)
class UpdateGroup:
    """One member's handle on a weight-update group."""

    name: str
    rank: int
    world_size: int
    backend: str
    pg: Any

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0 sends ``tensors`` in order; every other rank receives into them (same dtypes
        and shapes, allocated by the caller from the request's names/dtypes/shapes)."""
        try:
            for t in tensors:
                if not t.is_contiguous():
                    raise UpdateGroupError(f"update group {self.name!r}: a non-contiguous tensor")
                # gloo lacks some dtypes (float8): on gloo the bytes travel, which is the same data
                wire = t.reshape(-1).view(torch.uint8) if self.backend == "gloo" else t
                self.pg.broadcast(wire, 0).wait()
        except (RuntimeError, dist.DistBackendError) as exc:
            raise UpdateGroupError(
                f"update group {self.name!r} (rank {self.rank} of {self.world_size}): broadcast "
                f"failed: {exc}"
            ) from exc

    def destroy(self) -> None:
        """Leave the group (its name may then be used again)."""
        if self.backend == "gloo":  # never registered: dropping it closes its connections
            self.pg = None
            return
        with contextlib.suppress(RuntimeError, ValueError, KeyError, AssertionError):
            dist.destroy_process_group(self.pg)  # may be gone already with its peers


def join_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> UpdateGroup:
    """Join (rank 0: host) the group; blocks until all ``world_size`` members joined."""
    if backend not in ("gloo", "nccl"):
        raise UpdateGroupError(f"backend: {backend!r} is not gloo or nccl")
    if not 0 <= rank < world_size:
        raise UpdateGroupError(f"rank {rank} is outside a group of {world_size}")
    if backend == "nccl" and group_name in c10d._world.pg_names.values():
        raise UpdateGroupError(
            f"update group {group_name!r} already exists in this process: destroy it first"
        )
    timeout = timedelta(seconds=timeout_s)
    try:
        store, rank, world_size = next(
            rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
        prefixed = c10d.PrefixStore(group_name, store)
        if backend == "gloo":
            # the helper's own store layout for a gloo group ("<name>/cpu/" under the prefix),
            # built directly so that the group is not registered process-wide: a trainer and
            # an in-process engine can then each hold their end of one group
            inner = c10d.PrefixStore("cpu/", c10d.PrefixStore(f"{group_name}/", prefixed))
            pg: Any = dist.ProcessGroupGloo(inner, rank, world_size, timeout)
            pg._set_sequence_number_for_group()
        else:
            pg, _ = c10d._new_process_group_helper(
                world_size,
                rank,
                [],
                c10d.Backend(backend),
                prefixed,
                group_name=c10d.GroupName(group_name),
                timeout=timeout,
            )
            c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    except (RuntimeError, ValueError, OSError, dist.DistError) as exc:
        raise UpdateGroupError(
            f"update group {group_name!r} at {master_address}:{master_port} (rank {rank} of "
            f"{world_size}, {backend}): {type(exc).__name__}: {exc}"
        ) from exc
    return UpdateGroup(name=group_name, rank=rank, world_size=world_size, backend=backend, pg=pg)
