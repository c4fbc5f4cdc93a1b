"""Build and self-check the HSDP device mesh: one world mesh, unflattened into (replicate, shard).

``build_fsdp_mesh(spec)`` makes a 1-D world mesh ``("dp",)`` over all W ranks (the logical
data-parallel group: data split and loss scaling use it) and derives from it the 2-D sharding
view ``("dp_replicate", "dp_shard")`` with ``DeviceMesh._unflatten`` (private, torch >= 2.10).

Departures from the obvious:

* Torch without ``_unflatten`` (<= 2.9, some ROCm builds) falls back to a second root mesh from
  ``init_device_mesh(device_type, (r, s))``. It has the same rank layout but its own process
  groups (one more set of communicators); ``FsdpMesh.method`` says which path ran.
* Torch silently accepts a mesh *smaller* than the world (a rank then has coordinate None), so
  after building we compare the rank grid, this rank's coordinates and both of its groups
  against the spec ourselves and raise ``MeshBuildError`` on any difference.
* Everything that can be checked without a process group (numbers, device type) is checked
  first, so a bad spec never leaves half-created communicators behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.fsdp_mesh._errors import MeshBuildError, MeshConfigError
from posttrain.interface import MeshAxis, MeshSpec

WORLD_AXIS = "dp"
BuildMethod = Literal["auto", "unflatten", "init_device_mesh"]


def check_device_type(device_type: str) -> None:
    """Raise ``MeshConfigError`` unless ``device_type`` is a bare torch device type usable here."""
    try:
        device = torch.device(device_type)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise MeshConfigError(f"device_type {device_type!r} is not a torch device type") from exc
    if device.index is not None:
        raise MeshConfigError(
            f"device_type must be a bare type like 'cuda', got {device_type!r} (with an index)"
        )
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise MeshConfigError("device_type 'meta' cannot run collectives")
    try:
        module = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError) as exc:
        raise MeshConfigError(f"device_type {device_type!r} has no torch device module") from exc
    if not module.is_available():
        raise MeshConfigError(f"device_type {device_type!r} is not available on this host")


@dataclass(frozen=True, slots=True)
class FsdpMesh:
    """The meshes of one HSDP layout, checked against ``spec``.

    ``world`` is the 1-D logical data-parallel mesh over all W ranks; ``hsdp`` the 2-D
    ``(dp_replicate, dp_shard)`` view. ``sharding_mesh`` is what ``fully_shard`` gets: the 2-D
    mesh when ``replicate > 1``, else its 1-D ``dp_shard`` axis (plain FSDP, no all-reduce).
    """

    spec: MeshSpec
    world: DeviceMesh
    hsdp: DeviceMesh
    method: Literal["unflatten", "init_device_mesh"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The logical data-parallel group (all W ranks)."""
        return self.world.get_group()

    @property
    def dp_rank(self) -> int:
        return self.world.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.world.size()

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.hsdp.get_group(MeshAxis.DP_SHARD.value)

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        return self.hsdp.get_group(MeshAxis.DP_REPLICATE.value)

    @property
    def sharding_mesh(self) -> DeviceMesh:
        if self.spec.replicate == 1:
            return self.hsdp[MeshAxis.DP_SHARD.value]
        return self.hsdp

    def report(self) -> dict[str, Any]:
        """JSON-ready description of this rank's view of the layout."""
        rank = dist.get_rank()
        return {
            "rank": rank,
            "world_size": self.spec.world_size,
            "replicate": self.spec.replicate,
            "shard": self.spec.shard_size,
            "device_type": self.spec.device_type,
            "method": self.method,
            "coords": list(self.spec.coords(rank)),
            "shard_group": dist.get_process_group_ranks(self.shard_group),
            "replicate_group": dist.get_process_group_ranks(self.replicate_group),
            "sharding_mesh_ndim": self.sharding_mesh.ndim,
        }


def _unflatten_supported(mesh: DeviceMesh) -> bool:
    return callable(getattr(mesh, "_unflatten", None))


def build_fsdp_mesh(spec: MeshSpec, *, method: BuildMethod = "auto") -> FsdpMesh:
    """Build the world mesh and its (replicate, shard) view for ``spec``; collective on all ranks."""
    if method not in ("auto", "unflatten", "init_device_mesh"):
        raise MeshConfigError(
            f"method must be 'auto', 'unflatten' or 'init_device_mesh', got {method!r}"
        )
    check_device_type(spec.device_type)
    if not dist.is_available() or not dist.is_initialized():
        raise MeshBuildError(
            "torch.distributed is not initialized: call init_process_group before build_fsdp_mesh"
        )
    live = dist.get_world_size()
    if live != spec.world_size:
        raise MeshBuildError(
            f"spec world_size={spec.world_size} but the process group has {live} ranks"
        )
    r, s = spec.replicate, spec.shard_size
    names = (MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)
    world = init_device_mesh(spec.device_type, (spec.world_size,), mesh_dim_names=(WORLD_AXIS,))
    chosen: Literal["unflatten", "init_device_mesh"]
    if method == "auto":
        chosen = "unflatten" if _unflatten_supported(world) else "init_device_mesh"
    else:
        chosen = method
    if chosen == "unflatten":
        if not _unflatten_supported(world):
            raise MeshBuildError(
                f"torch {torch.__version__} has no DeviceMesh._unflatten; use method='auto'"
            )
        hsdp = world._unflatten(0, (r, s), names)
    else:
        hsdp = init_device_mesh(spec.device_type, (r, s), mesh_dim_names=names)
    mesh = FsdpMesh(spec=spec, world=world, hsdp=hsdp, method=chosen)
    check_mesh(mesh)
    return mesh


def check_mesh(mesh: FsdpMesh) -> None:
    """Compare the built meshes with the spec on this rank; raise ``MeshBuildError`` on a mismatch."""
    spec = mesh.spec
    rank = dist.get_rank()
    expected_grid = [list(spec.shard_group_ranks(i)) for i in range(spec.replicate)]
    grid = mesh.hsdp.mesh.tolist()
    if grid != expected_grid:
        raise MeshBuildError(f"rank {rank}: HSDP mesh grid {grid} != spec grid {expected_grid}")
    if mesh.world.mesh.tolist() != list(range(spec.world_size)):
        raise MeshBuildError(
            f"rank {rank}: world mesh {mesh.world.mesh.tolist()} does not cover all "
            f"{spec.world_size} ranks exactly once"
        )
    coords = mesh.hsdp.get_coordinate()
    if coords is None or tuple(coords) != spec.coords(rank):
        raise MeshBuildError(
            f"rank {rank}: mesh coordinate {coords} != spec coordinate {spec.coords(rank)}"
        )
    i, j = spec.coords(rank)
    got_shard = list(dist.get_process_group_ranks(mesh.shard_group))
    got_rep = list(dist.get_process_group_ranks(mesh.replicate_group))
    if got_shard != list(spec.shard_group_ranks(i)):
        raise MeshBuildError(
            f"rank {rank}: dp_shard group {got_shard} != spec {spec.shard_group_ranks(i)}"
        )
    if got_rep != list(spec.replicate_group_ranks(j)):
        raise MeshBuildError(
            f"rank {rank}: dp_replicate group {got_rep} != spec {spec.replicate_group_ranks(j)}"
        )
