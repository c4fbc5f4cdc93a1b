"""The state of expert-parallel MoE layers: checkpoint slices, full HF weights, the PEFT adapter,
and the gradient rule (see ``expert_parallel`` for the layer).

* ``local_moe_weights``: this EP rank's tensors of one MoE layer, from the HF-named tensors a
  checkpoint holds (per-expert or transformers-v5 stacked names); nothing is cast.
* ``gather_moe_weights``: one layer back under full HF names on every rank, bitwise (the
  parameters' bytes are all-gathered), so a checkpoint saved under one EP size loads under any.
* ``export_expert_lora``: the layers' LoRA factors under PEFT keys on every rank, bitwise.
* ``reduce_expert_parallel_grads``: router and shared-expert parameters (and their LoRA factors)
  SUM over TP when TP > 1 (each TP rank routed a different share of the tokens), then MEAN over
  DP; routed-expert parameters are local to their owner (no reduction across EP ranks, which
  hold different experts): SUM over expert-DP (the replicas of the same experts), then divide
  by the DP size, as Megatron's DDP scales expert grads. The result is the gradient of the mean
  of the per-DP-shard losses. The caller's own DP reduction must skip these parameters.
* ``expert_parallel_grad_norm_sq``: their squared grad norm, each expert counted once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.formats import peft_key
from posttrain.grpo._errors import GrpoConfigError, GrpoInputError
from posttrain.grpo.megatron._ep_comm import (
    ExpertParallelGroups,
    all_gather_bytes,
    all_reduce_scaled,
)
from posttrain.lora import LoraConfig, group_size
from posttrain.models import ModelConfig


class ExpertLayer(Protocol):
    """What this module reads of an expert-parallel MoE layer (``expert_parallel``'s
    ``ExpertParallelMoe``): its config and groups, router, experts, shared experts and LoRA factors. A
    protocol, so the layer's module may import this one and not the other way round."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def prefix(self) -> str: ...
    @property
    def layer_index(self) -> int: ...
    @property
    def groups(self) -> ExpertParallelGroups: ...
    @property
    def ep_size(self) -> int: ...
    @property
    def deepseek(self) -> bool: ...
    @property
    def router(self) -> Tensor: ...
    @property
    def expert_bias(self) -> Tensor: ...
    @property
    def experts_fc1(self) -> Tensor: ...
    @property
    def experts_fc2(self) -> Tensor: ...
    @property
    def shared_fc1(self) -> Tensor: ...
    @property
    def shared_fc2(self) -> Tensor: ...
    @property
    def lora_config(self) -> LoraConfig | None: ...
    @property
    def lora_A(self) -> torch.nn.ParameterDict: ...  # noqa: N802 (the layer's attribute name)
    @property
    def lora_B(self) -> torch.nn.ParameterDict: ...  # noqa: N802
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
    def is_expert_parameter(self, name: str) -> bool: ...


def lora_module_name(prefix: str, key: str, index: int) -> str:
    """PEFT module of LoRA site ``key`` (``gate``, ``experts_<part>`` or ``shared_experts_<part>``)
    for global expert (or shared expert) ``index``; ``prefix`` is ``model.layers.{i}.mlp.``."""
    if key == "gate":
        return prefix + "gate"
    for kind in ("shared_experts", "experts"):
        if key.startswith(kind + "_"):
            return f"{prefix}{kind}.{index}.{key.removeprefix(kind + '_')}"
    raise GrpoConfigError(f"unknown expert-layer LoRA site {key!r}", field="lora_targets")


# --------------------------------------------------------------------------- checkpoints


def _check_tensor(name: str, value: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(value.shape) != shape:
        raise GrpoInputError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
    if value.dtype != dtype:
        raise GrpoInputError(
            f"tensor {name!r} has dtype {value.dtype}, expected {dtype} (dtypes are never cast)"
        )
    if not bool(torch.isfinite(value).all()):
        raise GrpoInputError(f"tensor {name!r} holds non-finite values")


def _take(
    tensors: Mapping[str, Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> Tensor:
    if name not in tensors:
        raise GrpoInputError(f"checkpoint tensor {name!r} is missing")
    _check_tensor(name, tensors[name], shape, dtype)
    return tensors[name]


def _stack(
    tensors: Mapping[str, Tensor],
    container: str,
    experts: range,
    parts: tuple[str, ...],
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> Tensor:
    """``[len(experts), len(parts) * rows, cols]``: each expert's parts concatenated on rows."""
    return torch.stack(
        [
            torch.cat([_take(tensors, f"{container}.{j}.{p}.weight", shape, dtype) for p in parts])
            for j in experts
        ]
    )


def local_moe_weights(
    tensors: Mapping[str, Tensor],
    config: ModelConfig,
    layer_index: int,
    *,
    ep_rank: int,
    ep_size: int,
) -> dict[str, Tensor]:
    """EP rank ``ep_rank`` of ``ep_size``'s tensors of MoE layer ``layer_index``.

    ``tensors``: HF-named, as a checkpoint holds them (per-expert
    ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` or the stacked ``...experts.gate_up_proj``
    / ``...experts.down_proj``); names of other layers are ignored. Returns
    ``ExpertParallelMoe`` parameter names: ``router``, ``expert_bias`` (sigmoid router),
    ``experts_fc1 [E/ep, 2I, H]`` (``[gate; up]`` rows), ``experts_fc2 [E/ep, H, I]``,
    ``shared_fc1`` / ``shared_fc2`` (shared experts). Shapes and dtypes must match the config
    exactly; values must be finite. A DeepSeek-style layer (``config.is_mla``) has an fp32
    ``gate.weight [E, H]`` and one fused shared MLP (``...mlp.shared_experts.{gate,up,down}_proj``).
    """
    c = config
    e, ns = c.num_experts, c.n_shared_experts
    if ep_size < 1 or e % ep_size:
        raise GrpoConfigError(
            f"num_experts={e} is not divisible by ep_size={ep_size}", field="num_experts"
        )
    if not 0 <= ep_rank < ep_size:
        raise GrpoConfigError(f"ep_rank={ep_rank} is not in [0, {ep_size})", field="ep_rank")
    if not 0 <= layer_index < c.num_hidden_layers or not c.is_moe_layer(layer_index):
        raise GrpoConfigError(f"layer_index={layer_index} is not a MoE layer", field="layer_index")
    m, dt = f"model.layers.{layer_index}.mlp.", c.dtype
    h, i, si = c.hidden_size, c.moe_intermediate_size, c.shared_intermediate_size
    n = e // ep_size
    local = range(ep_rank * n, (ep_rank + 1) * n)
    deepseek = c.is_mla
    router = ((e, h), torch.float32) if deepseek else ((e + ns, h), dt)
    out = {"router": _take(tensors, m + "gate.weight", *router)}
    if deepseek or c.router_score_function == "sigmoid":
        bias = m + "gate.e_score_correction_bias"
        out["expert_bias"] = _take(tensors, bias, (e,), torch.float32)
    if m + "experts.gate_up_proj" in tensors or m + "experts.down_proj" in tensors:
        fc1 = _take(tensors, m + "experts.gate_up_proj", (e, 2 * i, h), dt)
        fc2 = _take(tensors, m + "experts.down_proj", (e, h, i), dt)
        out["experts_fc1"], out["experts_fc2"] = (
            fc1[local.start : local.stop],
            fc2[local.start : local.stop],
        )
    else:
        out["experts_fc1"] = _stack(
            tensors, m + "experts", local, ("gate_proj", "up_proj"), (i, h), dt
        )
        out["experts_fc2"] = _stack(tensors, m + "experts", local, ("down_proj",), (h, i), dt)
    if deepseek and ns:
        fused, sp = c.deepseek_moe_spec.shared_intermediate_size, m + "shared_experts."
        gate_up = [_take(tensors, f"{sp}{p}_proj.weight", (fused, h), dt) for p in ("gate", "up")]
        out["shared_fc1"] = torch.cat(gate_up)
        out["shared_fc2"] = _take(tensors, sp + "down_proj.weight", (h, fused), dt)
    elif ns:
        shared = range(ns)
        out["shared_fc1"] = _stack(
            tensors, m + "shared_experts", shared, ("gate_proj", "up_proj"), (si, h), dt
        )
        out["shared_fc2"] = _stack(
            tensors, m + "shared_experts", shared, ("down_proj",), (h, si), dt
        )
    return out


def gather_moe_weights(module: ExpertLayer) -> dict[str, Tensor]:
    """The layer's full HF-named tensors on every rank: the router (and its bias), every routed
    expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` and the shared experts; bitwise copies
    of the parameters (collective over ``ep``)."""
    c, m = module.config, module.prefix
    i, si = c.moe_intermediate_size, c.shared_intermediate_size
    out: dict[str, Tensor] = {m + "gate.weight": module.router.detach().clone()}
    if module.deepseek or c.router_score_function == "sigmoid":
        out[m + "gate.e_score_correction_bias"] = module.expert_bias.detach().clone()
    fc1, fc2 = module.experts_fc1.detach(), module.experts_fc2.detach()
    group = module.groups.ep
    if group is not None and module.ep_size > 1:
        ranks = all_gather_bytes([fc1, fc2], group)
        fc1, fc2 = (torch.cat([r[j] for r in ranks]) for j in (0, 1))
    for j in range(c.num_experts):
        out[f"{m}experts.{j}.gate_proj.weight"] = fc1[j, :i].clone()
        out[f"{m}experts.{j}.up_proj.weight"] = fc1[j, i:].clone()
        out[f"{m}experts.{j}.down_proj.weight"] = fc2[j].clone()
    if module.deepseek and c.n_shared_experts:
        fc1, fused = module.shared_fc1.detach(), module.shared_fc2.shape[1]
        out[f"{m}shared_experts.gate_proj.weight"] = fc1[:fused].clone()
        out[f"{m}shared_experts.up_proj.weight"] = fc1[fused:].clone()
        out[f"{m}shared_experts.down_proj.weight"] = module.shared_fc2.detach().clone()
        return out
    for s in range(c.n_shared_experts):
        out[f"{m}shared_experts.{s}.gate_proj.weight"] = module.shared_fc1[s, :si].detach().clone()
        out[f"{m}shared_experts.{s}.up_proj.weight"] = module.shared_fc1[s, si:].detach().clone()
        out[f"{m}shared_experts.{s}.down_proj.weight"] = module.shared_fc2[s].detach().clone()
    return out


def export_expert_lora(
    modules: Sequence[ExpertLayer], *, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The LoRA factors of ``modules`` under PEFT keys (``base_model.model.<module>.lora_A.weight``),
    whole on every rank (routed experts all-gathered over ``ep``), sorted by key, in ``dtype``
    (default: the LoRA config's ``export_dtype``); collective over ``ep``. Merge it with the
    rest of the model's adapter (``posttrain.lora.export_adapter``)."""
    out: dict[str, Tensor] = {}
    export_dtype = dtype
    for module in modules:
        if module.lora_config is None:
            raise GrpoConfigError(
                f"export_expert_lora: MoE layer {module.layer_index} has no LoRA",
                field="lora_targets",
            )
        export_dtype = export_dtype or module.lora_config.export_dtype
        factors = {
            (key, f): (module.lora_A if f == "A" else module.lora_B)[key].detach()
            for key in module.lora_A
            for f in ("A", "B")
        }
        routed = [kf for kf in factors if kf[0].startswith("experts_")]  # EP-sharded
        group = module.groups.ep
        if routed and group is not None and module.ep_size > 1:
            ranks = all_gather_bytes([factors[kf] for kf in routed], group)
            for j, kf in enumerate(routed):
                factors[kf] = torch.cat([r[j] for r in ranks])
        for (key, f), value in factors.items():
            if value.ndim == 2:  # the router: one module
                out[peft_key(lora_module_name(module.prefix, key, 0), f)] = value
                continue
            for j in range(value.shape[0]):  # global expert id, or shared expert index
                out[peft_key(lora_module_name(module.prefix, key, j), f)] = value[j]
    assert export_dtype is not None
    return {k: out[k].to(export_dtype).contiguous().clone() for k in sorted(out)}


# --------------------------------------------------------------------------- gradients


def _shared_groups(modules: Sequence[ExpertLayer]) -> ExpertParallelGroups:
    if not modules:
        raise GrpoConfigError("no ExpertParallelMoe modules given", field="modules")
    groups = modules[0].groups
    if any(mod.groups is not groups for mod in modules):
        raise GrpoConfigError(
            "the ExpertParallelMoe modules must share one ExpertParallelGroups", field="modules"
        )
    return groups


def _grads(modules: Sequence[ExpertLayer], *, expert: bool) -> list[Tensor]:
    out = []
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad or module.is_expert_parameter(name) != expert:
                continue
            if p.grad is None:  # no token reached it here; a peer may have one: reduce zeros
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
    return out


def reduce_expert_parallel_grads(modules: Sequence[ExpertLayer]) -> None:
    """Reduce the grads of every trainable parameter of ``modules`` in place by the rule of the
    module doc (one fp32 all-reduce per group); collective over ``tp``, ``dp`` and
    ``expert_dp``. Call it once per step, after the backward of every micro-batch."""
    g = _shared_groups(modules)
    dp = group_size(g.dp)
    replicated = _grads(modules, expert=False)
    all_reduce_scaled(replicated, g.tp, 1.0)
    all_reduce_scaled(replicated, g.dp, 1.0 / dp)
    all_reduce_scaled(_grads(modules, expert=True), g.expert_dp, 1.0 / dp)


def expert_parallel_grad_norm_sq(modules: Sequence[ExpertLayer]) -> float:
    """Squared L2 norm of the (reduced) grads of ``modules``: expert grads summed over ``ep``,
    replicated ones counted once. Add it to the rest of the model's; collective over ``ep``."""
    g = _shared_groups(modules)

    def total(grads: list[Tensor]) -> Tensor:
        sq = [gr.detach().double().pow(2).sum() for gr in grads]
        return torch.stack(sq).sum() if sq else torch.zeros((), dtype=torch.float64)

    replicated = total(_grads(modules, expert=False)).cpu()
    experts = total(_grads(modules, expert=True)).reshape(1)
    if group_size(g.ep) > 1:
        experts = experts.to(modules[0].router.device)
        dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=g.ep)
    return float(replicated + experts.cpu()[0])


__all__ = [
    "expert_parallel_grad_norm_sq",
    "export_expert_lora",
    "gather_moe_weights",
    "local_moe_weights",
    "lora_module_name",
    "reduce_expert_parallel_grads",
]
