"""Gather full (unsharded) weights from an FSDP2/HSDP model, on any device type.

``gather_full_param`` redistributes a DTensor to all-``Replicate`` on its own mesh, so on the
HSDP mesh only the shard group talks (replicas already hold the same shard); plain tensors pass
through. ``iter_full_state_dict`` walks ``model.state_dict()`` in order and gathers it in
buckets: consecutive parameters sharded on dim 0 over the same mesh dimension, of one dtype,
go as one all-gather of their shards packed end to end (each shard padded to its tensor's
largest), up to ``bucket_bytes`` of full tensors at a time, so peak memory stays one bucket
beyond the shards and a weight sync of N parameters costs about N / bucket collectives, not
N. Anything else (plain tensors, other placements, a CPU-offloaded shard of a GPU mesh) takes
``gather_full_param``. The bytes are the same either way.

Departure from the usual helper: nothing is hard-coded to CUDA. The collective runs on the
mesh's device type (a CPU-offloaded shard is moved there first) and the result is returned on
``device`` (default: CPU), so the same code exports weights on gloo/CPU and NCCL/GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard


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


DEFAULT_BUCKET_BYTES = 64 << 20  # full-tensor bytes per all-gather of iter_full_state_dict


def iter_full_state_dict(
    model: nn.Module,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every entry of ``model.state_dict()``, in its order;
    all ranks call it. Dim-0-sharded parameters are gathered in buckets of about
    ``bucket_bytes`` (module docstring); ``bucket_bytes`` < 1 is refused."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
    bucket: list[tuple[str, DTensor]] = []
    key: tuple[object, ...] | None = None
    size = 0
    for name, value in model.state_dict().items():
        k = _bucket_key(value)
        nbytes = value.numel() * value.element_size()
        if bucket and (k != key or size + nbytes > bucket_bytes):
            yield from _gather_bucket(bucket, device, dtype)
            bucket, size = [], 0
        if k is None:
            yield name, gather_full_param(value, device=device, dtype=dtype)
            continue
        bucket.append((name, value))  # a DTensor: _bucket_key said so
        key, size = k, size + nbytes
    yield from _gather_bucket(bucket, device, dtype)


def _bucket_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What tensors gathered together must share (mesh, its sharded dimension, dtype), or None
    for one that takes ``gather_full_param``: not a DTensor, not sharded on dim 0 over exactly
    one mesh dimension (and replicated over the others), or whose shard lives off the mesh's
    device type."""
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return None
    sharded = [i for i, p in enumerate(tensor.placements) if _dim0(p)]
    if len(sharded) != 1 or any(
        not isinstance(p, Replicate) for i, p in enumerate(tensor.placements) if i != sharded[0]
    ):
        return None
    mesh = tensor.device_mesh
    if tensor.to_local().device.type != mesh.device_type:
        return None
    return (id(mesh), sharded[0], tensor.dtype)


def _dim0(placement: object) -> bool:
    """Plain ``Shard(0)`` (not a strided or other subclass: their rows are not contiguous)."""
    return type(placement) is Shard and placement.dim == 0


def _rows_of(rank: int, rows: int, world: int) -> int:
    """How many of ``rows`` rank ``rank``'s shard holds: dim 0 cut as ``torch.chunk`` cuts it
    (ceil(rows / world) each; the last ranks may hold fewer or none)."""
    per = -(-rows // world)
    return max(0, min(per, rows - per * rank))


def _gather_bucket(
    bucket: list[tuple[str, DTensor]], device: torch.device | str, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather for a bucket of dim-0-sharded parameters (same mesh dimension, dtype):
    each rank packs its shards end to end, every shard padded to its tensor's largest."""
    if not bucket:
        return
    first = bucket[0][1]
    mesh = first.device_mesh
    dim = next(i for i, p in enumerate(first.placements) if _dim0(p))
    world = mesh.size(dim)
    with torch.no_grad():
        slots = []  # per tensor: padded elements per rank, elements per row
        for _, t in bucket:
            row = math.prod(t.shape[1:])  # global shape: no DTensor op, no collective
            slots.append((-(-t.shape[0] // world) * row, row))
        total = sum(slot for slot, _ in slots)
        local = first.to_local()
        send = torch.zeros(total, dtype=first.dtype, device=local.device)
        at = 0
        for (_, t), (slot, _) in zip(bucket, slots, strict=True):
            shard = t.to_local().reshape(-1)
            send[at : at + shard.numel()] = shard
            at += slot
        if world == 1:  # nothing to gather (as redistribute: no collective, no group needed)
            received = [send]
        else:
            received = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(received, send, group=mesh.get_group(dim))
        at = 0
        for (name, t), (slot, row) in zip(bucket, slots, strict=True):
            pieces = []
            for r in range(world):
                pieces.append(received[r][at : at + _rows_of(r, t.shape[0], world) * row])
            full = torch.cat(pieces).view(t.shape)
            yield name, full.to(device=device, dtype=dtype or full.dtype)
            at += slot
