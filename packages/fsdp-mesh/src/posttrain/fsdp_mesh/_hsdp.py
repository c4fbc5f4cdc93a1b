"""Wrap a model with FSDP2 ``fully_shard`` on the (replicate, shard) mesh.

``apply_hsdp(model, mesh, config)`` shards every block (the classes named in
``model._no_split_modules``, else each element of every ``nn.ModuleList``, or what ``wrap``
selects) and then the root, all on ``mesh.sharding_mesh``: parameters are ``Shard(0)`` over
``dp_shard`` and ``Replicate`` over ``dp_replicate``. Defaults: bf16 compute, fp32 gradient
reduction, reshard after forward, no CPU offload.

Departures from the obvious: the gradient divide factor is checked to equal the *logical* data
parallel size W (all ranks), never the shard size: FSDP2 averages over replicate x shard, which
is what plain data parallelism over W gives, so the loss is scaled exactly as without HSDP.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from posttrain.fsdp_mesh._errors import MeshBuildError, MeshConfigError
from posttrain.fsdp_mesh._mesh import FsdpMesh

WrapPolicy = Callable[[nn.Module], bool] | Sequence[type[nn.Module]]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class HsdpConfig:
    """How ``apply_hsdp`` shards: dtypes (None keeps the parameter dtype), offload, resharding.

    ``cast_forward_inputs``: FSDP2 casts the floating tensors a unit's forward gets to
    ``param_dtype`` (its default); off, they reach the forward as they were passed (a model
    that keeps an fp32 residual stream between bf16 layers). ``forward_prefetch``: each block
    all-gathers the next block's parameters when its own forward starts (blocks must then run
    in registration order in every forward, as a decoder's layers do).
    """

    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    cast_forward_inputs: bool = True
    forward_prefetch: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise MeshConfigError(f"{name} must be a floating dtype or None, got {value}")
        for flag in ("reshard_after_forward", "cast_forward_inputs", "forward_prefetch"):
            if not isinstance(getattr(self, flag), bool):
                raise MeshConfigError(f"{flag} must be a bool, got {getattr(self, flag)!r}")


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if m is not model and type(m).__name__ in names]
    blocks: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            blocks.extend(m)
    return blocks


def _select_blocks(model: nn.Module, wrap: WrapPolicy | None) -> list[nn.Module]:
    if wrap is None:
        return _default_blocks(model)
    if callable(wrap) and not isinstance(wrap, Sequence):
        return [m for m in model.modules() if m is not model and wrap(m)]
    classes = tuple(wrap)
    return [m for m in model.modules() if m is not model and isinstance(m, classes)]


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every FSDP-managed module under (and including) ``model``, root last."""
    inner: list[FSDPModule] = [
        m for m in model.modules() if m is not model and isinstance(m, FSDPModule)
    ]
    return [*inner, model] if isinstance(model, FSDPModule) else inner


def apply_hsdp(
    model: nn.Module,
    mesh: FsdpMesh,
    config: HsdpConfig | None = None,
    *,
    wrap: WrapPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule:
    """Shard ``model`` in place (blocks, then root) on ``mesh``; returns the root FSDP module.

    ``ignored_params`` stay plain, unsharded tensors that FSDP neither gathers nor reduces
    (e.g. LoRA factors whose gradients ``lora-core`` reduces by its own rules).
    """
    config = config or HsdpConfig()
    if isinstance(model, FSDPModule):
        raise MeshConfigError(f"{type(model).__name__} is already FSDP-sharded")
    policy = MixedPrecisionPolicy(
        param_dtype=config.param_dtype,
        reduce_dtype=config.reduce_dtype,
        cast_forward_inputs=config.cast_forward_inputs,
    )
    offload: OffloadPolicy = OffloadPolicy()
    if config.cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU mesh offloading is a no-op anyway.
        offload = CPUOffloadPolicy(pin_memory=mesh.spec.device_type != "cpu")
    sharding_mesh = mesh.sharding_mesh
    blocks = _select_blocks(model, wrap)
    for block in blocks:
        fully_shard(
            block,
            mesh=sharding_mesh,
            mp_policy=policy,
            offload_policy=offload,
            reshard_after_forward=config.reshard_after_forward,
            ignored_params=ignored_params,
        )
    # The root's own parameters (embeddings, head) are gathered last in forward and first in
    # backward, so there is nothing to gain from resharding them after forward.
    root = fully_shard(
        model,
        mesh=sharding_mesh,
        mp_policy=policy,
        offload_policy=offload,
        reshard_after_forward=False if blocks else config.reshard_after_forward,
        ignored_params=ignored_params,
    )
    if config.forward_prefetch:
        units = [b for b in blocks if isinstance(b, FSDPModule)]
        for unit, following in itertools.pairwise(units):
            unit.set_modules_to_forward_prefetch([following])
    factor = sharding_mesh.size()
    if factor != mesh.dp_size:
        raise MeshBuildError(
            f"FSDP gradient divide factor {factor} != logical data-parallel size {mesh.dp_size}"
        )
    return root
