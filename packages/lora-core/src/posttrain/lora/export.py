"""``export_adapter``: the full PEFT-named adapter on every rank, in few collectives.

1. Each site emits its factors under PEFT names; a TP-sharded factor is queued with its concat
   dim (fused outputs are split into their parts first: gate and up, or q/k/v, are gathered
   separately, so the full gate is ``[g0; g1]``, never ``[g0; u0; g1; u1]``).
2. Flush: all queued shards of a group are flattened into one buffer (one dtype, else
   ``ExportError``), one flat all-gather, then split and concatenated. Collectives are
   O(groups), not O(tensors).
3. Padded vocab rows are dropped; a shared A is cloned per part (safetensors refuses aliases).
4. Pipeline stages: ``all_gather_object`` of (name, shape, dtype) over ``pp``, then one flat
   ``broadcast`` per (source stage, dtype). The result is sorted by name, cast to the export
   dtype and contiguous; every rank gets all of it (each engine TP worker slices for itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from posttrain.formats import peft_key
from posttrain.lora._errors import ExportError
from posttrain.lora.attach import LoraHandle, fused_local_parts
from posttrain.lora.comm import all_gather_flat, group_rank, group_size
from posttrain.lora.experts import LoraExpertLinear
from posttrain.lora.stacked import LoraStackedExperts


@dataclass(slots=True)
class _Pending:
    name: str
    local: torch.Tensor
    dim: int
    keep_rows: int | None


def _gather_batch(
    batch: list[_Pending], group: ProcessGroup | None, what: str
) -> dict[str, torch.Tensor]:
    if not batch:
        return {}
    n = group_size(group)
    first_of: dict[torch.dtype, str] = {}
    for p in batch:
        first_of.setdefault(p.local.dtype, p.name)
    if len(first_of) > 1:
        seen = ", ".join(
            f"{str(d).removeprefix('torch.')} ({name})" for d, name in first_of.items()
        )
        raise ExportError(
            f"export: mixed dtypes in one {what} gather batch: {seen}; "
            "give all LoRA factors one param_dtype"
        )
    flat = torch.cat([p.local.detach().reshape(-1) for p in batch])
    if n > 1:
        out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        all_gather_flat(out, flat, group)
        per_rank = out.chunk(n)
    else:
        per_rank = (flat,)
    result: dict[str, torch.Tensor] = {}
    sizes = [p.local.numel() for p in batch]
    split = [torch.split(chunk, sizes) for chunk in per_rank]
    for i, p in enumerate(batch):
        full = torch.cat([split[r][i].view_as(p.local) for r in range(n)], dim=p.dim)
        result[p.name] = full[: p.keep_rows] if p.keep_rows is not None else full
    return result


def _local_adapter(handle: LoraHandle) -> dict[str, torch.Tensor]:
    tp = group_size(handle.groups.tp)
    ready: dict[str, torch.Tensor] = {}
    pending: list[_Pending] = []
    expert_pending: list[_Pending] = []
    per_expert: list[LoraExpertLinear] = []
    for site in handle.sites.values():
        if isinstance(site, LoraStackedExperts):  # replicated: one PEFT module per expert and part
            a, b = site.lora_A.detach(), site.lora_B.detach()
            for e in range(site.num_experts):
                for p in range(len(site.parts)):
                    ready[peft_key(site.hf_name(e, p), "A")] = a[e, p].clone()
                    ready[peft_key(site.hf_name(e, p), "B")] = b[e, p].clone()
            continue
        if isinstance(site, LoraExpertLinear):
            a, b = site.lora_A.detach(), site.lora_B.detach()
            for factor, t in (("A", a), ("B", b)):
                key = peft_key(site.hf_name, factor)
                if site.shared == factor:
                    ready[key] = t.unsqueeze(0).clone()
                else:
                    expert_pending.append(_Pending(key, t, 0, None))
            if site.shared is None:
                per_expert.append(site)
            continue
        info = site.site
        a, b = site.lora_A.detach(), site.lora_B.detach()
        names = [name for name, _ in info.parts]
        sizes = [size for _, size in info.parts]
        if info.layout == "column":
            for name, part in zip(names, fused_local_parts(b, sizes, info.groups, tp), strict=True):
                pending.append(_Pending(peft_key(name, "B"), part, 0, info.unpadded_out))
                ready[peft_key(name, "A")] = a.clone()
        elif info.layout == "row":
            (name,) = names
            pending.append(_Pending(peft_key(name, "A"), a, 1, None))
            ready[peft_key(name, "B")] = b.clone()
        else:
            for name, part in zip(names, fused_local_parts(b, sizes, info.groups, 1), strict=True):
                keep = info.unpadded_out
                ready[peft_key(name, "B")] = (part[:keep] if keep else part).clone()
                ready[peft_key(name, "A")] = a.clone()
    ready.update(_gather_batch(pending, handle.groups.tp, "tensor-parallel"))
    ready.update(_gather_batch(expert_pending, handle.groups.ep, "expert-parallel"))
    for site in per_expert:  # explode stacked [E, ...] into one PEFT module per expert
        for factor in ("A", "B"):
            stacked = ready.pop(peft_key(site.hf_name, factor))
            for e in range(stacked.shape[0]):
                ready[peft_key(site.hf_name.format(expert=e), factor)] = stacked[e].clone()
    return ready


def _broadcast_stages(local: dict[str, torch.Tensor], pp: ProcessGroup) -> dict[str, torch.Tensor]:
    n = dist.get_world_size(pp)
    me = dist.get_rank(pp)
    meta = [
        (k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sorted(local.items())
    ]
    everyone: list[list[tuple[str, tuple[int, ...], str]] | None] = [None] * n
    dist.all_gather_object(everyone, meta, group=pp)
    device = next(iter(local.values())).device if local else torch.device("cpu")
    full: dict[str, torch.Tensor] = {}
    for stage in range(n):
        entries = everyone[stage] or []
        for dtype_name in sorted({d for _, _, d in entries}):
            dtype = getattr(torch, dtype_name)
            chosen = [(k, s) for k, s, d in entries if d == dtype_name]
            numels = [int(torch.Size(s).numel()) for _, s in chosen]
            if stage == me:
                buf = torch.cat([local[k].reshape(-1) for k, _ in chosen]).contiguous()
            else:
                buf = torch.empty(sum(numels), dtype=dtype, device=device)
            dist.broadcast(buf, src=dist.get_global_rank(pp, stage), group=pp)
            for (k, s), piece in zip(chosen, torch.split(buf, numels), strict=True):
                if k in full:
                    raise ExportError(f"export: tensor {k} comes from two pipeline stages")
                full[k] = piece.view(s) if stage != me else local[k]
    return full


def export_adapter(
    handle: LoraHandle,
    *,
    dtype: torch.dtype | None = None,
    fold_scaling_to: float | None = None,
) -> dict[str, torch.Tensor]:
    """The full adapter, PEFT-named, on every rank (collective over ``tp``, ``ep`` and ``pp``).

    ``dtype`` defaults to the config's ``export_dtype``. Tensors are fresh, contiguous, and
    sorted by name. ``fold_scaling_to``: for an engine that cannot express the training scale
    (e.g. rsLoRA), every B is multiplied by ``scaling / fold_scaling_to`` (in fp32, before the
    cast) so that serving with scale ``fold_scaling_to`` gives the same outputs; describe it to
    the engine as ``alpha = fold_scaling_to * r`` without rsLoRA, and checksum after folding.
    """
    local = _local_adapter(handle)
    pp = handle.groups.pp
    full = _broadcast_stages(local, pp) if pp is not None and group_size(pp) > 1 else local
    if not full:
        where = f"pipeline rank {group_rank(pp)}" if pp is not None else "this rank"
        raise ExportError(f"export: the adapter is empty on {where}")
    out_dtype = dtype or handle.config.export_dtype
    if fold_scaling_to is not None:
        if not fold_scaling_to > 0:
            raise ExportError(f"export: fold_scaling_to must be > 0, got {fold_scaling_to!r}")
        factor = handle.config.scaling / fold_scaling_to
        full = {
            k: v.float() * factor if k.endswith(".lora_B.weight") else v for k, v in full.items()
        }
    return {k: full[k].to(out_dtype).contiguous().clone() for k in sorted(full)}
