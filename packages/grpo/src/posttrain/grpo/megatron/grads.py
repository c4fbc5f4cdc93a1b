"""Explicit gradient reduction and the true global grad norm of a ``TensorParallelDecoder``.

After the backward of a rank's (DP-share) loss, the base weights' gradients are:

* TP shards (qkv, proj, fc1, fc2): complete for their slice (megatron's mappings already summed
  what crossed TP);
* ``q_norm`` / ``k_norm``: one ``[head_dim]`` weight shared by all heads, and each TP rank
  computed only its heads, so each holds a partial sum: SUM over TP;
* with sequence parallelism, every other weight inside the layers (``attn_norm``,
  ``mlp_norm``, router, experts) saw only the rank's tokens: SUM over TP as well;
* the rest (embedding, final norm, LM head; every layer weight without SP) is computed whole and
  identically on each TP rank: complete.

The expert-parallel MoE layers (``expert_model_parallel_size > 1``) reduce their own grads
(``expert_parallel.reduce_expert_parallel_grads``) and add their own squares to the norm.

Then every gradient is averaged over the data-parallel group (ranks of one TP group see the
same samples, so the loss of each is scaled by ``dp_size`` and the mean is the global-batch
gradient). All in fp32, coalesced: one all-reduce per (group, dtype).

``grad_norm`` counts each element once: a shard's squares are summed over TP, a replicated
weight is counted on this rank only, so the norm equals the single-process one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from posttrain.grpo.megatron._ep_comm import all_reduce_scaled
from posttrain.grpo.megatron.expert_parallel import (
    ExpertParallelMoe,
    expert_parallel_grad_norm_sq,
    reduce_expert_parallel_grads,
)
from posttrain.grpo.megatron.model import TensorParallelDecoder

_HEAD_SHARED = ("q_norm", "k_norm")


def tp_partial_parameters(model: TensorParallelDecoder) -> list[nn.Parameter]:
    """The replicated weights whose gradient is a partial sum over TP (module docstring)."""
    if model.groups.tp_size == 1:
        return []
    out = []
    for name, p in model.replicated_parameters().items():
        leaf = name.rsplit(".", 1)[-1]
        in_layers = name.startswith("layers.")
        if leaf in _HEAD_SHARED or (model.sequence_parallel and in_layers):
            out.append(p)
    return out


def _expert_layers(model: TensorParallelDecoder) -> list[ExpertParallelMoe]:
    layers = model.expert_parallel_layers()
    assert all(isinstance(m, ExpertParallelMoe) for m in layers)
    return layers  # type: ignore[return-value]


def reduce_gradients(model: TensorParallelDecoder, params: list[nn.Parameter]) -> None:
    """TP SUM of partial base grads, then DP mean of ``params``' grads (collective). The
    expert-parallel layers' own grads follow their rule (``reduce_expert_parallel_grads``:
    router and shared experts SUM over TP and MEAN over DP, routed experts over expert-DP)."""
    groups = model.groups
    experts = _expert_layers(model)
    own = {id(p) for m in experts for p in m.parameters()}
    params = [p for p in params if id(p) not in own]
    partial = {id(p) for p in tp_partial_parameters(model)}
    all_reduce_scaled(
        [p.grad for p in params if id(p) in partial and p.grad is not None], groups.tp, 1.0
    )
    grads = [p.grad for p in params if p.grad is not None]
    all_reduce_scaled(grads, groups.dp, 1.0 / groups.dp_size)
    if experts and any(p.requires_grad for m in experts for p in m.parameters()):
        reduce_expert_parallel_grads(experts)


def grad_norm(model: TensorParallelDecoder, params: list[nn.Parameter]) -> float:
    """Global L2 norm of the base-weight grads in ``params`` (collective over TP)."""
    sharded = {id(s.site.weight) for s in model.shards.values()}
    experts = _expert_layers(model)
    own = {id(p) for m in experts for p in m.parameters()}
    local = torch.zeros(2, dtype=torch.float64)
    if experts and any(p.requires_grad for m in experts for p in m.parameters()):
        local[1] += expert_parallel_grad_norm_sq(experts)  # already summed over EP
    for p in params:
        if id(p) in own:
            continue
        if p.grad is None:
            continue
        sq = p.grad.detach().to(torch.float64).pow(2).sum().cpu()
        local[0 if id(p) in sharded else 1] += sq
    if model.groups.tp_size > 1:
        part = local[:1].to(_device(params))
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=model.groups.tp)
        local[0] = part.cpu()[0]
    return math.sqrt(float(local.sum()))


def _device(params: list[nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")
