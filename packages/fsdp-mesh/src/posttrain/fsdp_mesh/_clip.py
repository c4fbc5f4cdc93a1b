"""Global gradient norm and clipping for FSDP2/HSDP DTensor gradients.

Each rank holds 1/s of every gradient (``Shard(0)`` over ``dp_shard``) and the same values as
its replicas (``Replicate`` over ``dp_replicate``). The global norm therefore sums ``|g|^p`` over
the local shards, all-reduces over the *shard* axis only (summing over the replicate axis too
would count every element r times), and takes the p-th root. Gradients are grouped by the
process groups of their sharded mesh axes, so a model mixing meshes (or plain replicated
tensors) is still correct; all grouped sums are reduced and combined in one pass.

Departures from ``torch.nn.utils.clip_grad_norm_``: returns a Python float that is identical on
every rank (no ``DTensor.full_tensor()`` round trip by the caller), accumulates in float64, and
leaves gradients untouched when the norm is not finite (the caller should skip the step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.fsdp_mesh._errors import MeshConfigError

ParamsOrModule = nn.Module | Iterable[torch.Tensor]


def _grads(parameters: ParamsOrModule) -> list[torch.Tensor]:
    params = parameters.parameters() if isinstance(parameters, nn.Module) else parameters
    return [p.grad for p in params if p.grad is not None]


def grad_norm(parameters: ParamsOrModule, norm_type: float = 2.0) -> float:
    """The global ``norm_type``-norm of all gradients, the same float on every rank."""
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise MeshConfigError(f"norm_type must be positive (or inf), got {norm_type}")
    is_inf = math.isinf(norm_type)
    partial: dict[tuple[dist.ProcessGroup, ...], torch.Tensor] = {}
    devices: dict[tuple[dist.ProcessGroup, ...], str] = {}
    for g in _grads(parameters):
        groups: tuple[dist.ProcessGroup, ...] = ()
        local = g
        device = g.device.type
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            for axis, placement in enumerate(g.placements):
                if placement.is_partial():
                    raise MeshConfigError(
                        f"gradient with placements {g.placements} is still Partial; "
                        "reduce it before taking its norm"
                    )
                if placement.is_shard():
                    groups += (mesh.get_group(axis),)
            local = g.to_local()
            device = mesh.device_type
        local64 = local.detach().to(torch.float64)
        if local64.numel() == 0:
            value = torch.zeros((), dtype=torch.float64)
        elif is_inf:
            value = local64.abs().max()
        else:
            value = torch.linalg.vector_norm(local64, norm_type) ** norm_type
        value = value.to(device)
        prev = partial.get(groups)
        if prev is None:
            partial[groups] = value
        else:
            partial[groups] = torch.maximum(prev, value) if is_inf else prev + value
        devices[groups] = device
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    total = 0.0
    for groups, value in sorted(partial.items(), key=lambda kv: len(kv[0])):
        for group in groups:
            dist.all_reduce(value, op=op, group=group)
        v = float(value.item())
        total = max(total, v) if is_inf else total + v
    return total if is_inf else total ** (1.0 / norm_type)


def clip_grad_norm(parameters: ParamsOrModule, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm``; returns the norm.

    Every rank must call it (it all-reduces over the shard axis). The returned value is the norm
    *before* clipping, as with torch's helper.
    """
    if not (max_norm > 0):
        raise MeshConfigError(f"max_norm must be positive, got {max_norm}")
    if not isinstance(parameters, nn.Module):
        parameters = list(parameters)
    total = grad_norm(parameters, norm_type)
    scale_grads_to_norm(parameters, total, max_norm)
    return total


def scale_grads_to_norm(parameters: ParamsOrModule, total_norm: float, max_norm: float) -> None:
    """Scale gradients in place by ``max_norm / total_norm`` when that is below 1.

    ``total_norm`` is the global norm, computed by the caller (``grad_norm``, or lora-core's
    ``lora_grad_norm`` for adapter factors outside FSDP); a non-finite norm changes nothing
    (the caller skips that step). Local: no collective.
    """
    if not (max_norm > 0):
        raise MeshConfigError(f"max_norm must be positive, got {max_norm}")
    if not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in _grads(parameters):
                g.mul_(coef)
