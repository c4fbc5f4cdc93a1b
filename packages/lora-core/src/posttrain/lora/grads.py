"""Explicit gradient reduction and the true global grad norm for LoRA factors.

Rules (``reduce_lora_grads``), applied in fp32 whatever the grad dtype, each bucket coalesced
into one collective per (group, rule):

1. TP SUM of factors tagged ``tp_partial`` (column+SP A, row+SP B): each TP rank saw only its
   token slice.
2. EP SUM of factors tagged ``ep_partial`` (shared-outer expert factors replicated over EP while
   tokens are split over EP).
3. DP: dense factors MEAN over ``dp``; expert factors (``expert=True``) SUM over ``expert_dp``
   then divide by the size of ``dp`` (Megatron's expert-grad scaling), so every factor ends as
   the gradient of the mean of the per-rank losses.

With ``after_dp_finish=True`` (a framework's DDP already ran step 3, and Megatron's
``finalize_model_grads`` already did step 1 for params flagged ``sequence_parallel``) only step 2
runs. Running step 1 before an *overlapped* DP reduce-scatter is a race (the reduce-scatter may
start on the partial grad): ``overlap_grad_reduce=True`` without ``after_dp_finish`` raises.

``verify_replicas`` checks that replicated factors (or grads) are bitwise equal across their
groups and names the first tensor and rank that is not.

``lora_grad_norm`` counts each factor once: sharded factors sum squares over their group,
replicated ones are counted on one copy, stages add up over ``pp``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from posttrain.lora._errors import LoraConfigError, ReplicaMismatchError
from posttrain.lora.attach import LoraGroups, LoraHandle
from posttrain.lora.comm import all_gather_flat, group_size
from posttrain.lora.layers import LoraParamTag


def _tag(p: nn.Parameter) -> LoraParamTag:
    tag: LoraParamTag = p.lora_tag  # type: ignore[attr-defined]
    return tag


def _coalesced_all_reduce(
    grads: list[torch.Tensor], group: ProcessGroup | None, scale: float
) -> None:
    if not grads:
        return
    flat = torch.cat([g.detach().reshape(-1).to(torch.float32) for g in grads])
    if group_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def _grads(params: Iterable[nn.Parameter]) -> list[tuple[nn.Parameter, torch.Tensor]]:
    return [(p, p.grad) for p in params if p.grad is not None]


def reduce_lora_grads(
    handle: LoraHandle,
    *,
    after_dp_finish: bool = False,
    overlap_grad_reduce: bool = False,
) -> None:
    """Reduce the LoRA grads of ``handle`` in place by the rules of the module docstring."""
    if overlap_grad_reduce and not after_dp_finish:
        raise LoraConfigError(
            "reduce_lora_grads: overlap_grad_reduce=True needs after_dp_finish=True "
            "(the TP/EP sums must not race an overlapped DP reduce-scatter)"
        )
    g = handle.groups
    pairs = _grads(handle.parameters())
    if not after_dp_finish:
        _coalesced_all_reduce([gr for p, gr in pairs if _tag(p).tp_partial], g.tp, 1.0)
    _coalesced_all_reduce([gr for p, gr in pairs if _tag(p).ep_partial], g.ep, 1.0)
    if after_dp_finish:
        return
    dp = group_size(g.dp)
    _coalesced_all_reduce([gr for p, gr in pairs if not _tag(p).expert], g.dp, 1.0 / dp)
    expert_dp = g.expert_dp if g.ep is not None else g.dp
    _coalesced_all_reduce([gr for p, gr in pairs if _tag(p).expert], expert_dp, 1.0 / dp)


def _check_group(
    named: list[tuple[str, torch.Tensor]], group: ProcessGroup | None, axis: str
) -> None:
    n = group_size(group)
    if n == 1 or not named:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for _, t in named])
    peers = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather_flat(peers, flat, group)
    me = dist.get_rank(group)
    for r, chunk in enumerate(peers.chunk(n)):
        if r == me or torch.equal(chunk, flat):
            continue
        offset = 0
        for name, t in named:
            if not torch.equal(
                chunk[offset : offset + t.numel()], flat[offset : offset + t.numel()]
            ):
                raise ReplicaMismatchError(
                    f"{name} differs between {axis} ranks {me} and {r} (global rank "
                    f"{dist.get_rank()}); it must be identical across its {axis} group"
                )
            offset += t.numel()


def verify_replicas(handle: LoraHandle, *, grads: bool = False) -> None:
    """Raise ``ReplicaMismatchError`` unless every replicated factor (or its grad) is bitwise
    equal across the groups it is replicated over (collective over tp, dp, ep, expert_dp)."""
    g = handle.groups
    expert_dp = g.expert_dp if g.ep is not None else g.dp
    buckets: dict[str, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, p in handle.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        label = f"{name}.grad" if grads else name
        tag = _tag(p)
        if tag.expert:
            buckets["expert_dp"].append((label, t))
            if tag.shard_axis is None:
                buckets["ep"].append((label, t))
        else:
            buckets["dp"].append((label, t))
            if tag.shard_axis is None:
                buckets["tp"].append((label, t))
    for axis, group in (("tp", g.tp), ("dp", g.dp), ("ep", g.ep), ("expert_dp", expert_dp)):
        _check_group(buckets[axis], group, axis)


def _shard_group(tag: LoraParamTag, groups: LoraGroups) -> ProcessGroup | None:
    if tag.shard_axis == "tp":
        return groups.tp
    if tag.shard_axis == "ep":
        return groups.ep
    return None


def lora_grad_norm_sq(handle: LoraHandle) -> float:
    """Squared L2 norm of all LoRA grads of the whole model (collective over tp, ep, pp)."""
    g = handle.groups
    buckets: dict[str | None, torch.Tensor] = defaultdict(
        lambda: torch.zeros((), dtype=torch.float64)
    )
    device = None
    for p, gr in _grads(handle.parameters()):
        device = gr.device
        axis: str | None = _tag(p).shard_axis
        buckets[axis] = buckets[axis] + gr.detach().to(torch.float64).pow(2).sum().cpu()
    axes: list[str | None] = [None, "tp", "ep"]
    vec = torch.stack([buckets[a] for a in axes]).to(device or "cpu")
    for i, axis in enumerate(axes[1:], start=1):
        group = g.tp if axis == "tp" else g.ep
        if group_size(group) > 1:
            part = vec[i : i + 1].clone()
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
            vec[i] = part[0]
    total = vec.sum().reshape(1)
    if group_size(g.pp) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=g.pp)
    return float(total.item())


def lora_grad_norm(handle: LoraHandle) -> float:
    """Global L2 norm of the LoRA grads, equal to the single-process norm (collective)."""
    return math.sqrt(lora_grad_norm_sq(handle))
