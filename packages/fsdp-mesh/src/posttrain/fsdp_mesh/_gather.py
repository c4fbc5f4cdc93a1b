"""Gather full (unsharded) weights from an FSDP2/HSDP model, on any device type.

``gather_full_param`` redistributes a DTensor to all-``Replicate`` on its own mesh, so on the
HSDP mesh only the shard group talks (replicas already hold the same shard); plain tensors pass
through. ``iter_full_state_dict`` walks ``model.state_dict()`` one tensor at a time, which keeps
peak memory to one full tensor beyond the shards, for streaming weights into an engine.

Departure from the usual helper: nothing is hard-coded to CUDA. The collective runs on the
mesh's device type (a CPU-offloaded shard is moved there first) and the result is returned on
``device`` (default: CPU), so the same code exports weights on gloo/CPU and NCCL/GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def gather_full_param(
    tensor: torch.Tensor,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The full value of ``tensor`` (collective over its mesh when it is a DTensor)."""
    with torch.no_grad():
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            dt: DTensor = tensor
            if dt.to_local().device.type != mesh.device_type:
                dt = dt.to(mesh.device_type)  # type: ignore[assignment]
            replicated = dt.redistribute(mesh, [Replicate()] * mesh.ndim)
            full = replicated.to_local()
        else:
            full = tensor.detach()
        out: torch.Tensor = full.to(device=device, dtype=dtype or full.dtype).clone()
        return out


def iter_full_state_dict(
    model: nn.Module,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every entry of ``model.state_dict()``; all ranks call it."""
    for name, value in model.state_dict().items():
        yield name, gather_full_param(value, device=device, dtype=dtype)
