"""The (replicate x shard) layout of W data-parallel ranks, validated before any process group exists.

Stand-in for ``posttrain.interface.MeshSpec`` until that lands on main: same field and method
names (``world_size, replicate, shard, device_type``; ``coords``, ``shard_group_ranks``,
``replicate_group_ranks``), pure Python, no torch.distributed.

The logical data-parallel domain is always all W ranks; only the *sharding* domain splits into
``replicate`` x ``shard``. Rank g sits at ``(g // shard, g % shard)``: shard groups are contiguous
blocks (put them inside a node), replicate groups are strided sets (the only cross-node traffic).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from posttrain.fsdp_mesh._errors import MeshConfigError


class MeshAxis(StrEnum):
    """Names of the two axes of the HSDP mesh (outer axis first)."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MeshConfigError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise MeshConfigError(f"{name} must be at least 1, got {value}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshSpec:
    """W = replicate * shard data-parallel ranks; validated on construction."""

    world_size: int
    replicate: int
    shard: int
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        w = _check_positive_int("world_size", self.world_size)
        r = _check_positive_int("replicate", self.replicate)
        s = _check_positive_int("shard", self.shard)
        if w % r:
            raise MeshConfigError(f"world_size({w}) must be divisible by replicate({r})")
        if r * s != w:
            raise MeshConfigError(f"replicate({r}) * shard({s}) = {r * s} != world_size({w})")
        if not isinstance(self.device_type, str) or not self.device_type:
            raise MeshConfigError(
                f"device_type must be a non-empty string, got {self.device_type!r}"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise MeshConfigError(f"rank {rank} is outside world_size({self.world_size})")

    def coords(self, rank: int) -> tuple[int, int]:
        """(replicate index, shard index) of global rank ``rank``."""
        self._check_rank(rank)
        return divmod(rank, self.shard)

    def shard_group_ranks(self, i: int) -> tuple[int, ...]:
        """Ranks of the i-th shard group (replicate index i): a contiguous block of ``shard``."""
        if not 0 <= i < self.replicate:
            raise MeshConfigError(f"shard group {i} is outside replicate({self.replicate})")
        return tuple(range(i * self.shard, (i + 1) * self.shard))

    def replicate_group_ranks(self, j: int) -> tuple[int, ...]:
        """Ranks of the j-th replicate group (shard index j): ``replicate`` ranks strided by shard."""
        if not 0 <= j < self.shard:
            raise MeshConfigError(f"replicate group {j} is outside shard({self.shard})")
        return tuple(j + k * self.shard for k in range(self.replicate))
