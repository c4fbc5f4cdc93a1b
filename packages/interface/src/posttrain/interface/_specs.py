"""Validated specs shared across packages: LoRA, device mesh, NVFP4 precision.

Each spec checks itself on construction and names the offending field and
value, so a bad configuration fails before any process group, file or
connection exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from posttrain.interface._errors import ConfigError


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraSpec:
    """What a LoRA adapter is: rank, alpha, the modules it targets, dropout, rsLoRA scaling."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"LoraSpec.r must be an int >= 1, got {self.r!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"LoraSpec.alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.target_modules, str):
            raise ConfigError("LoraSpec.target_modules must be a sequence of names, not one string")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not self.target_modules or any(not name for name in self.target_modules):
            raise ConfigError(
                f"LoraSpec.target_modules must be non-empty names, got {list(self.target_modules)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoraSpec.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def scaling(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class MeshAxis(StrEnum):
    """Named axes of the hybrid-sharded data-parallel mesh (the mesh's "axis", a tensor's "dim")."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"


KNOWN_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "npu", "mps")


@dataclass(kw_only=True, slots=True, frozen=True)
class MeshSpec:
    """A (replicate r) x (shard s) data-parallel mesh over ``world_size`` ranks.

    Rank g sits at ``(g // s, g % s)``: shard groups are contiguous ranks (one
    node, usually) and replicate groups stride by s. ``shard`` defaults to
    ``world_size // replicate``. Validation happens here, before any process
    group exists.
    """

    world_size: int
    replicate: int = 1
    shard: int | None = None
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("world_size", "replicate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MeshSpec.{name} must be an int >= 1, got {value!r}")
        if self.world_size % self.replicate != 0:
            raise ConfigError(
                f"MeshSpec: world_size {self.world_size} is not divisible by replicate "
                f"{self.replicate}"
            )
        if self.shard is None:
            object.__setattr__(self, "shard", self.world_size // self.replicate)
        elif isinstance(self.shard, bool) or not isinstance(self.shard, int) or self.shard < 1:
            raise ConfigError(f"MeshSpec.shard must be an int >= 1, got {self.shard!r}")
        if self.replicate * self.shard_size != self.world_size:
            raise ConfigError(
                f"MeshSpec: replicate {self.replicate} x shard {self.shard_size} = "
                f"{self.replicate * self.shard_size} does not cover world_size {self.world_size}"
            )
        if self.device_type not in KNOWN_DEVICE_TYPES:
            raise ConfigError(
                f"MeshSpec.device_type {self.device_type!r} is not one of {', '.join(KNOWN_DEVICE_TYPES)}"
            )

    @property
    def shard_size(self) -> int:
        assert self.shard is not None  # set in __post_init__
        return self.shard

    @property
    def shape(self) -> tuple[int, int]:
        return (self.replicate, self.shard_size)

    @property
    def axis_names(self) -> tuple[str, str]:
        return (MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside world_size {self.world_size}")

    def coords(self, rank: int) -> tuple[int, int]:
        """(replicate index, shard index) of a global rank."""
        self._check_rank(rank)
        return divmod(rank, self.shard_size)

    def shard_group_ranks(self, replicate_index: int) -> list[int]:
        """The contiguous ranks that shard parameters together in replica ``replicate_index``."""
        if not 0 <= replicate_index < self.replicate:
            raise ConfigError(
                f"replicate index {replicate_index} is outside replicate {self.replicate}"
            )
        start = replicate_index * self.shard_size
        return list(range(start, start + self.shard_size))

    def replicate_group_ranks(self, shard_index: int) -> list[int]:
        """The ranks that hold the same shard ``shard_index`` and all-reduce it across replicas."""
        if not 0 <= shard_index < self.shard_size:
            raise ConfigError(f"shard index {shard_index} is outside shard {self.shard_size}")
        return [r * self.shard_size + shard_index for r in range(self.replicate)]


class FourOverSix(StrEnum):
    """The 4-over-6 NVFP4 block-scale choice: off, or pick the map by MAE or MSE."""

    OFF = "off"
    MAE = "mae"
    MSE = "mse"


class ScaleRounding(StrEnum):
    """How the NVFP4 block scale is derived: TE's current multiplier form or its older divide form."""

    TE_MULTIPLIER = "te-multiplier"
    TE_DIVIDE = "te-divide"


@dataclass(kw_only=True, slots=True, frozen=True)
class NVFP4Precision:
    """The NVFP4 precision contract a converter and an engine must agree on.

    E2M1 values in 1x``group_size`` blocks with float8_e4m3fn block scales and an
    fp32 global scale; ``input_scale`` is the activation scale written beside
    each weight (None: not written); ``kv_cache_quant_algo`` "FP8" or None.
    """

    group_size: int = 16
    scale_rounding: ScaleRounding = ScaleRounding.TE_MULTIPLIER
    four_over_six: FourOverSix = FourOverSix.OFF
    input_scale: float | None = 1.0
    kv_cache_quant_algo: Literal["FP8"] | None = "FP8"

    def __post_init__(self) -> None:
        if self.group_size != 16:
            raise ConfigError(f"NVFP4Precision.group_size must be 16, got {self.group_size!r}")
        for name, enum in (("scale_rounding", ScaleRounding), ("four_over_six", FourOverSix)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                allowed = ", ".join(m.value for m in enum)
                raise ConfigError(
                    f"NVFP4Precision.{name} must be one of {allowed}, got {value!r}"
                ) from None
        if self.input_scale is not None and (
            not math.isfinite(self.input_scale) or self.input_scale <= 0
        ):
            raise ConfigError(
                f"NVFP4Precision.input_scale must be a finite number > 0 or None, got {self.input_scale!r}"
            )
        if self.kv_cache_quant_algo not in ("FP8", None):
            raise ConfigError(
                f"NVFP4Precision.kv_cache_quant_algo must be 'FP8' or None, got {self.kv_cache_quant_algo!r}"
            )
