"""Expert parallelism (EP) for the MoE layers of a ``posttrain.models`` decoder, on any backend.

``ExpertParallelMoe`` is one MoE layer of a ``ModelConfig`` (softmax or sigmoid router with its
fixed expert bias, ``norm_topk_prob``, ``routed_scaling_factor``, optional shared experts) whose
routed experts are split over an expert-parallel process group: EP rank ``r`` of ``ep`` holds
experts ``[r * E / ep, (r + 1) * E / ep)``. Its ``forward(m)`` is ``DecoderModel.moe`` for the
post-norm hidden states ``m [T, H]`` of this rank.

Why our own dispatch, not megatron-core's ``MoELayer``
------------------------------------------------------
megatron-core 0.16.1's MoE layer does not run on CPU with gloo: its all-to-all token dispatcher
creates a ``torch.cuda.Stream`` when it is built, its router moves its weight to
``torch.cuda.current_device()`` on the first forward, and the layer takes its groups from
megatron's global ``parallel_state``. It also computes with its own kernels (grouped GEMM, its
own top-k, softmax and un-permute order), so strict numerics (the engine's bits) could not hold.
So tokens are dispatched here with explicit all-to-alls over explicit groups, and every expert
runs the model's own kernels (``strict_ops_for`` of the device: ``linear``, ``silu_mul``, ``moe_combine``).

How it maps to Megatron's EP (expert_tensor_parallel_size = 1, the ``alltoall`` dispatcher)
--------------------------------------------------------------------------------------------
* Groups (``ExpertParallelLayout``, Megatron's rank order ``tp-cp-ep-dp-pp`` without CP/PP):
  TP groups are blocks of consecutive ranks and DP groups are strided by TP (dense layers);
  EP groups are blocks of ``ep`` consecutive ranks and expert-DP groups strided by ``ep``
  (experts). With TP2 x EP2 on 4 ranks the EP group of a rank is its TP group.
* Dispatch (dropless, no capacity factor): each rank sorts its (token, slot) assignments by
  expert id, exchanges per-expert counts (one all-to-all of ``E`` ints), then the token rows
  (an all-to-all with those splits); the owner groups the rows it received by local expert,
  runs each expert, and the reverse all-to-all returns the rows, which are put back in
  (token, slot) order and combined with ``ops.moe_combine`` in the single-process slot order
  (shared experts ``0..S-1``, then routed experts by ascending id).
* Tokens entering the layer: with sequence parallel (or TP = 1) each rank routes its own
  tokens. Without sequence parallel (hidden states replicated over TP), the layer takes this
  TP rank's contiguous share of the tokens, routes it, and all-gathers the outputs over TP
  (megatron-core refuses EP with TP and without SP instead). Either way each token is routed
  once per TP group, so no expert sees a token twice.
* The router and the shared experts are replicated on every rank (Megatron TP-shards its
  shared experts; ours are small and stay whole). They see only this rank's tokens, so with
  TP > 1 their grads are partial sums over TP, marked ``sequence_parallel`` as Megatron marks
  its router under SP.

Numerics: each routed row is computed alone by the model's row-independent kernels and the
combine order is the single-process one, so in strict numerics the layer's output is bitwise
equal to ``DecoderModel.moe`` on the same tokens (with or without LoRA). Gradients agree to
a relative L2 of about 1e-7 (measured in the gloo tests): an expert's weight grad sums its
tokens in another order, and the TP/DP/expert-DP reductions add partial grads.

Autograd: the all-to-alls' backward is the reverse all-to-all (``_ep_comm``, which also says
how every rank is made to run each backward collective, even a rank that routed or received
no token). Grad mode and trainability must agree across the ranks of a group.

DeepSeek-style blocks (the MLA families, ``config.is_mla``: an ``MlaLayer``'s ``layer.moe``)
split the same way: their fp32 router has no shared-expert rows, routing is
``group_limited_routing`` (group-limited sigmoid top-k with the correction bias), and the shared
experts are one fused SwiGLU MLP (``shared_fc1 [2 * S * I, H]``, ``shared_fc2 [H, S * I]``)
whose output weighs 1, combined first as the single-process block does. Its experts are not LoRA
targets (``attach_lora`` refuses them, as the single-process model has no hook there).

Gradients, checkpoints and the adapter live in ``expert_state`` (re-exported here):
``reduce_expert_parallel_grads`` (router and shared parameters SUM over TP, MEAN over DP;
routed-expert parameters are local to their owner, SUM over expert-DP divided by the DP
size; the caller's own DP reduction must skip all of them), ``expert_parallel_grad_norm_sq``,
``local_moe_weights`` / ``gather_moe_weights`` (EP slice from HF names and back, bitwise) and
``export_expert_lora``. Parameters also carry Megatron's attributes (``allreduce=False`` on
expert parameters, ``sequence_parallel`` on the rest when TP > 1).

LoRA (``attach_lora``): per-expert adapters in the PEFT layout the engine serves
(``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}``, the shared experts and
the router ``mlp.gate``), each initialised from its PEFT name by ``lora-core``'s
``init_full_factor`` (so any EP size draws the same bits) and computed with
``posttrain.formats.lora_delta`` on the model's kernel, as the engine's ``LoraRouting`` does.

Integration (a decoder's MoE block): build one ``ExpertParallelMoe`` per MoE layer with the
rank's ``ExpertParallelGroups`` (``new_expert_parallel_groups(ExpertParallelLayout(...))`` or
your own groups), ``load_hf_weights(checkpoint_tensors)``, call ``layer(m)`` where the decoder
calls ``_moe`` (``m`` = post-attention RMSNorm output, fp32), and after backward call
``reduce_expert_parallel_grads(layers)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from posttrain.formats import PeftFormatError, lora_delta, peft_modules
from posttrain.grpo._errors import GrpoConfigError, GrpoInputError
from posttrain.grpo.megatron._ep_comm import (
    ExpertParallelGroups,
    all_gather_bytes,
    all_to_all_counts,
    all_to_all_rows,
    gather_token_shares,
    inverse_permutation,
    share_sizes,
    take_token_share,
)
from posttrain.grpo.megatron.expert_state import (
    expert_parallel_grad_norm_sq,
    export_expert_lora,
    gather_moe_weights,
    local_moe_weights,
    lora_module_name,
    reduce_expert_parallel_grads,
)
from posttrain.lora import LoraConfig, group_rank, group_size, init_full_factor
from posttrain.models import (
    FastOps,
    ModelConfig,
    Numerics,
    group_limited_routing,
    moe_routing,
    strict_ops_for,
)

__all__ = [
    "LORA_TARGETS",
    "ExpertParallelGroups",
    "ExpertParallelLayout",
    "ExpertParallelMoe",
    "expert_parallel_grad_norm_sq",
    "export_expert_lora",
    "gather_moe_weights",
    "local_moe_weights",
    "new_expert_parallel_groups",
    "reduce_expert_parallel_grads",
]

Axis = Literal["tp", "dp", "ep", "expert_dp"]
LORA_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate")
"""PEFT module suffixes ``attach_lora`` accepts: expert projections (routed and shared) and the
router (``mlp.gate``)."""


# --------------------------------------------------------------------------- layout and groups


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertParallelLayout:
    """The ranks of a (TP, EP, DP) world in Megatron's order (expert TP 1, no PP or CP).

    ``data_parallel_size = world / tp`` for dense layers; ``expert_data_parallel_size =
    world / ep`` for experts. ``ranks(axis)`` lists every group of an axis.
    """

    world_size: int
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GrpoConfigError(
                    f"ExpertParallelLayout.{name} must be a positive int, got {value!r}",
                    field=name,
                )
        for name in ("tensor_parallel_size", "expert_parallel_size"):
            if self.world_size % getattr(self, name):
                raise GrpoConfigError(
                    f"ExpertParallelLayout.{name}={getattr(self, name)} does not divide "
                    f"world_size={self.world_size}",
                    field=name,
                )

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // self.expert_parallel_size

    def ranks(self, axis: Axis) -> list[list[int]]:
        """Every group of ``axis``: TP and EP are consecutive blocks, DP and expert-DP strided."""
        w, tp, ep = self.world_size, self.tensor_parallel_size, self.expert_parallel_size
        block = {"tp": tp, "ep": ep}.get(axis)
        if block is not None:
            return [list(range(s, s + block)) for s in range(0, w, block)]
        step = {"dp": tp, "expert_dp": ep}.get(axis)
        if step is None:
            raise GrpoConfigError(f"ExpertParallelLayout.ranks: unknown axis {axis!r}")
        return [list(range(j, w, step)) for j in range(step)]

    def check_num_experts(self, num_experts: int) -> None:
        """Raise unless ``num_experts`` splits evenly over the expert-parallel size."""
        if num_experts < 1 or num_experts % self.expert_parallel_size:
            raise GrpoConfigError(
                f"num_experts={num_experts} is not divisible by expert_parallel_size="
                f"{self.expert_parallel_size}",
                field="num_experts",
            )


def new_expert_parallel_groups(
    layout: ExpertParallelLayout, *, sequence_parallel: bool = False
) -> ExpertParallelGroups:
    """Create every group of ``layout`` (collective over the world, same order on every rank)
    and return this rank's. Axes of size 1 are ``None``."""
    if not dist.is_initialized():
        raise GrpoConfigError("new_expert_parallel_groups: torch.distributed is not initialized")
    if dist.get_world_size() != layout.world_size:
        raise GrpoConfigError(
            f"ExpertParallelLayout.world_size={layout.world_size} but the world has "
            f"{dist.get_world_size()} ranks",
            field="world_size",
        )
    me = dist.get_rank()
    mine: dict[str, ProcessGroup | None] = {}
    for axis in ("tp", "dp", "ep", "expert_dp"):
        mine[axis] = None
        for ranks in layout.ranks(axis):
            if len(ranks) == 1:
                break
            group = dist.new_group(ranks)
            if me in ranks:
                mine[axis] = group
    return ExpertParallelGroups(sequence_parallel=sequence_parallel, **mine)


def _check_member(group: ProcessGroup | None, field: str) -> None:
    if group is not None and group_rank(group) < 0:
        raise GrpoConfigError(
            f"rank {dist.get_rank()} is not a member of ExpertParallelGroups.{field}", field=field
        )


# --------------------------------------------------------------------------- the layer


class ExpertParallelMoe(nn.Module):
    """One MoE layer (``layer_index`` of ``config``) with its routed experts split over ``groups.ep``.

    Parameters (names as ``posttrain.models.MoeLayer``): ``router [E + S, H]``, frozen fp32
    ``expert_bias [E]`` (sigmoid router), ``experts_fc1 [E/ep, 2I, H]`` (``[gate; up]`` rows)
    and ``experts_fc2 [E/ep, H, I]`` for the local experts ``first_expert ..``, and
    ``shared_fc1 / shared_fc2`` (``S`` shared experts). Building it checks the layout
    (collective over ``groups.expert_dp``). Fill it with ``load_hf_weights``.
    """

    router: nn.Parameter
    expert_bias: nn.Parameter
    experts_fc1: nn.Parameter
    experts_fc2: nn.Parameter
    shared_fc1: nn.Parameter
    shared_fc2: nn.Parameter

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        groups: ExpertParallelGroups | None = None,
        *,
        numerics: Numerics = Numerics.STRICT,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        groups = groups or ExpertParallelGroups()
        if not 0 <= layer_index < config.num_hidden_layers or not config.is_moe_layer(layer_index):
            raise GrpoConfigError(
                f"layer_index={layer_index} is not a MoE layer of this config", field="layer_index"
            )
        for field in ("ep", "expert_dp", "dp", "tp"):
            _check_member(getattr(groups, field), field)
        self.config, self.layer_index, self.groups = config, layer_index, groups
        self.deepseek = config.is_mla  # a DeepSeek-style block (see the module doc)
        self.numerics = Numerics(numerics)
        self.ep_size, self.ep_rank = group_size(groups.ep), group_rank(groups.ep)
        e, ns = config.num_experts, config.n_shared_experts
        if e % self.ep_size:
            raise GrpoConfigError(
                f"num_experts={e} of layer {layer_index} is not divisible by the size "
                f"{self.ep_size} of ExpertParallelGroups.ep",
                field="num_experts",
            )
        dense = group_size(groups.tp) * group_size(groups.dp)
        expert = self.ep_size * group_size(groups.expert_dp)
        if dense != expert:
            raise GrpoConfigError(
                f"ExpertParallelGroups span {dense} ranks as tp x dp but {expert} as "
                "ep x expert_dp; both must cover the same ranks (is dp or expert_dp missing?)",
                field="dp" if dense < expert else "expert_dp",
            )
        self.num_local_experts = e // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.prefix = f"model.layers.{layer_index}.mlp."
        h, i, si, dt = (
            config.hidden_size,
            config.moe_intermediate_size,
            config.shared_intermediate_size,
            config.dtype,
        )
        n = self.num_local_experts

        def zeros(*shape: int, dtype: torch.dtype = dt) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        if self.deepseek:  # fp32 router without shared rows; one fused shared MLP
            self.router = nn.Parameter(zeros(e, h, dtype=torch.float32))
        else:
            self.router = nn.Parameter(zeros(e + ns, h))
        if self.deepseek or config.router_score_function == "sigmoid":
            self.expert_bias = nn.Parameter(zeros(e, dtype=torch.float32), requires_grad=False)
        self.experts_fc1 = nn.Parameter(zeros(n, 2 * i, h))
        self.experts_fc2 = nn.Parameter(zeros(n, h, i))
        if self.deepseek and ns:
            fused = config.deepseek_moe_spec.shared_intermediate_size
            self.shared_fc1 = nn.Parameter(zeros(2 * fused, h))
            self.shared_fc2 = nn.Parameter(zeros(h, fused))
        elif ns:
            self.shared_fc1 = nn.Parameter(zeros(ns, 2 * si, h))
            self.shared_fc2 = nn.Parameter(zeros(ns, h, si))
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.lora_config: LoraConfig | None = None
        for name, param in self.named_parameters():
            self._mark(name, param)
        self._check_expert_dp()

    @property
    def ops(self) -> type[FastOps]:
        # the model's strict kernels for this device (Triton on CUDA), so EP keeps its bits
        return strict_ops_for(self.router.device) if self.numerics is Numerics.STRICT else FastOps

    def is_expert_parameter(self, name: str) -> bool:
        """Whether parameter ``name`` belongs to the local routed experts (EP-sharded)."""
        return name.startswith(("experts_", "lora_A.experts_", "lora_B.experts_"))

    def _mark(self, name: str, param: nn.Parameter) -> None:
        # Megatron's DDP / finalize_model_grads read these (see the module doc).
        expert = self.is_expert_parameter(name)
        param.allreduce = not expert  # type: ignore[attr-defined]
        param.sequence_parallel = not expert and group_size(self.groups.tp) > 1  # type: ignore[attr-defined]
        param.tensor_model_parallel = False  # type: ignore[attr-defined]

    def _check_expert_dp(self) -> None:
        group = self.groups.expert_dp
        if group is None or group_size(group) == 1:
            return
        mine = torch.tensor([self.ep_rank], dtype=torch.long, device=self.router.device)
        peers = [int(r[0][0]) for r in all_gather_bytes([mine], group)]
        if any(p != self.ep_rank for p in peers):
            raise GrpoConfigError(
                f"ExpertParallelGroups.expert_dp of rank {dist.get_rank()} joins EP ranks "
                f"{peers}: its members must hold the same experts (one EP rank)",
                field="expert_dp",
            )

    # ------------------------------------------------------------------ forward

    def forward(self, m: Tensor) -> Tensor:
        """MoE output ``[T, H]`` (fp32) of the post-norm hidden states ``m [T, H]`` of this
        rank (TP-local tokens with sequence parallel, else the TP group's replicated tokens);
        collective over ``ep`` (and ``tp`` without sequence parallel)."""
        if m.ndim != 2 or m.shape[1] != self.config.hidden_size:
            raise GrpoInputError(
                f"ExpertParallelMoe(layer {self.layer_index}): m has shape {tuple(m.shape)}, "
                f"expected [tokens, {self.config.hidden_size}]"
            )
        anchor = None
        if torch.is_grad_enabled():
            anchor = next((p for p in self.parameters() if p.requires_grad), None)
        tp = self.groups.tp
        if tp is None or group_size(tp) == 1 or self.groups.sequence_parallel:
            return self._moe(m, anchor)
        # tokens replicated over TP: route this rank's share, all-gather the outputs
        sizes = share_sizes(m.shape[0], group_size(tp))
        y = self._moe(take_token_share(m, sizes, tp, anchor=anchor), anchor)
        return gather_token_shares(y, sizes, tp, anchor=anchor)

    def _moe(self, x: Tensor, anchor: Tensor | None) -> Tensor:
        cfg, ops = self.config, self.ops
        ns = cfg.n_shared_experts
        logits = self._with_lora(x, ops.linear(x, self.router), "gate", 0)
        if self.deepseek:
            return self._deepseek_moe(x, logits, anchor)
        bias = getattr(self, "expert_bias", None)
        ids, weights = moe_routing(ops, cfg, logits, bias)  # the model's own routing
        outputs = self._routed(x, ids, anchor)
        if ns:
            shared = [
                self._expert(x, self.shared_fc1[s], self.shared_fc2[s], "shared_experts", s)
                for s in range(ns)
            ]
            outputs = torch.cat([torch.stack(shared, dim=1), outputs], dim=1)
        return ops.moe_combine(weights, outputs)

    def _deepseek_moe(self, x: Tensor, logits: Tensor, anchor: Tensor | None) -> Tensor:
        """``DeepseekMoe.forward`` with the routed experts dispatched over EP: its routing,
        then the shared output (weight 1) first and the routed ones by ascending id."""
        ops, spec = self.ops, self.config.deepseek_moe_spec
        ids, weights = group_limited_routing(ops, spec, logits, self.expert_bias)
        outputs = self._routed(x, ids, anchor)
        if not spec.n_shared_experts:
            return ops.moe_combine(weights, outputs)
        shared = self._expert(x, self.shared_fc1, self.shared_fc2, "shared_experts", 0)
        ones = weights.new_ones(weights.shape[0], 1)
        return ops.moe_combine(
            torch.cat([ones, weights], dim=1), torch.cat([shared[:, None], outputs], dim=1)
        )

    def _routed(self, x: Tensor, ids: Tensor, anchor: Tensor | None) -> Tensor:
        """``[T, k, H]``: slot ``s`` of token ``t`` holds expert ``ids[t, s]``'s output."""
        t, k = ids.shape
        h, e, n, ep = (
            self.config.hidden_size,
            self.config.num_experts,
            self.num_local_experts,
            self.ep_size,
        )
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # assignments grouped by expert
        x_send = x[order // k]
        per_expert = torch.bincount(flat, minlength=e)
        group = self.groups.ep
        if group is None or ep == 1:
            recv_counts, x_recv = per_expert.view(1, n), x_send
        else:
            recv_counts = all_to_all_counts(per_expert, group).view(ep, n)  # [source, expert]
            send = per_expert.view(ep, n).sum(1).tolist()
            recv = recv_counts.sum(1).tolist()
            x_recv = all_to_all_rows(x_send, send, recv, group, anchor=anchor)
        local = torch.arange(n, device=x.device).repeat(recv_counts.shape[0])
        by_expert = torch.sort(
            local.repeat_interleave(recv_counts.reshape(-1)), stable=True
        ).indices
        chunks = torch.split(x_recv[by_expert], recv_counts.sum(0).tolist())
        ys = [
            self._expert(c, self.experts_fc1[j], self.experts_fc2[j], "experts", j)
            for j, c in enumerate(chunks)
            if c.shape[0]
        ]
        y_sorted = torch.cat(ys) if ys else x_recv.new_zeros((0, h))
        y_recv = y_sorted[inverse_permutation(by_expert)]
        if group is not None and ep > 1:
            y_recv = all_to_all_rows(y_recv, recv, send, group, anchor=anchor, tie=x_recv)
        return y_recv[inverse_permutation(order)].reshape(t, k, h)

    def _expert(self, x: Tensor, fc1: Tensor, fc2: Tensor, kind: str, index: int) -> Tensor:
        ops = self.ops
        i = fc2.shape[1]
        gu = ops.linear(x, fc1)
        if f"{kind}_gate_proj" in self.lora_A or f"{kind}_up_proj" in self.lora_A:
            gate = self._with_lora(x, gu[:, :i], f"{kind}_gate_proj", index)
            up = self._with_lora(x, gu[:, i:], f"{kind}_up_proj", index)
            gu = torch.cat([gate, up], dim=1)
        act = ops.silu_mul(gu[:, :i], gu[:, i:])
        return self._with_lora(act, ops.linear(act, fc2), f"{kind}_down_proj", index)

    def _with_lora(self, x: Tensor, y: Tensor, key: str, index: int) -> Tensor:
        """``y + lora_delta(x)`` for LoRA site ``key`` (expert ``index``), as ``LoraRouting``."""
        if key not in self.lora_A or self.lora_config is None:
            return y
        a, b = self.lora_A[key], self.lora_B[key]
        if a.ndim == 3:
            a, b = a[index], b[index]
        return y + lora_delta(x, a, b, self.lora_config.scaling, linear=self.ops.linear)

    # ------------------------------------------------------------------ LoRA

    def _lora_sites(self, targets: Iterable[str]) -> dict[str, tuple[int, int, int]]:
        """``{site key: (number of stacked modules or 0, in, out)}`` for the targets."""
        cfg = self.config
        h, i, si = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
        sites: dict[str, tuple[int, int, int]] = {}
        for part in targets:
            if part == "gate":
                sites["gate"] = (0, h, cfg.num_experts + cfg.n_shared_experts)
                continue
            dims = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[part]
            sites[f"experts_{part}"] = (self.num_local_experts, *dims)
            if cfg.n_shared_experts:
                d_in, d_out = (h, si) if part != "down_proj" else (si, h)
                sites[f"shared_experts_{part}"] = (cfg.n_shared_experts, d_in, d_out)
        return sites

    def lora_module_name(self, key: str, index: int) -> str:
        """The PEFT module of LoRA site ``key`` for local expert (or shared expert) ``index``."""
        if key.startswith("experts_"):
            index += self.first_expert
        return lora_module_name(self.prefix, key, index)

    def attach_lora(self, config: LoraConfig, targets: Sequence[str]) -> None:
        """Add LoRA factors to the ``targets`` (``LORA_TARGETS`` suffixes) and freeze every base
        parameter. Each factor is drawn from its PEFT name, so any EP size gets the same bits."""
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown or not targets:
            raise GrpoConfigError(
                f"lora_targets {unknown or list(targets)} are not expert-layer LoRA targets "
                f"(choose from {', '.join(LORA_TARGETS)})",
                field="lora_targets",
            )
        if self.lora_config is not None:
            raise GrpoConfigError(
                f"LoRA is already attached to MoE layer {self.layer_index}", field="lora_targets"
            )
        if self.deepseek:
            raise GrpoConfigError(
                f"lora_targets: the DeepSeek-style MoE of layer {self.layer_index} "
                f"({self.config.family}) has no LoRA sites (its experts and router are not "
                "LoRA targets); adapt the attention and dense MLP projections",
                field="lora_targets",
            )
        for p in self.parameters():
            p.requires_grad_(False)
        r, device = config.r, self.router.device
        for key, (count, d_in, d_out) in self._lora_sites(targets).items():
            names = [self.lora_module_name(key, j) for j in range(max(count, 1))]
            a = [init_full_factor(config, nm, "A", (r, d_in)) for nm in names]
            b = [init_full_factor(config, nm, "B", (d_out, r)) for nm in names]
            a_t = torch.stack(a) if count else a[0]
            b_t = torch.stack(b) if count else b[0]
            self.lora_A[key] = nn.Parameter(a_t.to(device=device, dtype=config.param_dtype))
            self.lora_B[key] = nn.Parameter(b_t.to(device=device, dtype=config.param_dtype))
            self._mark(f"lora_A.{key}", self.lora_A[key])
            self._mark(f"lora_B.{key}", self.lora_B[key])
        self.lora_config = config

    def lora_parameters(self) -> list[nn.Parameter]:
        """Every LoRA factor of this layer (A then B per site)."""
        return [p for key in self.lora_A for p in (self.lora_A[key], self.lora_B[key])]

    def load_lora(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy this rank's factors from a whole PEFT adapter (modules of other layers are
        ignored). Every attached module must be there with its shapes, dtype and finite
        values; a module of this layer that is not attached is refused (it would not train)."""
        if self.lora_config is None:
            raise GrpoConfigError("load_lora: attach_lora first", field="lora_targets")
        mine = {k: v for k, v in tensors.items() if self.prefix in k}
        try:
            modules = peft_modules(mine, where=f"adapter (MoE layer {self.layer_index})")
        except PeftFormatError as err:
            raise GrpoInputError(str(err)) from err
        cfg = self.config
        known = {
            lora_module_name(self.prefix, key, j)
            for key in self.lora_A
            for j in range(
                cfg.num_experts
                if key.startswith("experts_")
                else cfg.n_shared_experts
                if key.startswith("shared_")
                else 1
            )
        }
        extra = sorted(set(modules) - known)
        if extra:
            raise GrpoInputError(
                f"adapter module {extra[0]!r} is not a LoRA target of MoE layer "
                f"{self.layer_index} (attached: {', '.join(self.lora_A)})"
            )
        with torch.no_grad():
            for key in self.lora_A:
                self._load_site(key, modules)

    def _load_site(self, key: str, modules: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        a_p, b_p = self.lora_A[key], self.lora_B[key]
        count = a_p.shape[0] if a_p.ndim == 3 else 0
        for j in range(max(count, 1)):
            name = self.lora_module_name(key, j)
            if name not in modules:
                raise GrpoInputError(f"adapter has no LoRA factors for module {name!r}")
            dst_a, dst_b = (a_p[j], b_p[j]) if count else (a_p, b_p)
            for factor, src, dst in zip("AB", modules[name], (dst_a, dst_b), strict=True):
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise GrpoInputError(
                        f"LoRA {factor} of {name!r} is {tuple(src.shape)} {src.dtype}, expected "
                        f"{tuple(dst.shape)} {dst.dtype}"
                    )
                dst.copy_(src)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def load_hf_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy this rank's slice of the layer from HF-named checkpoint tensors (see
        ``local_moe_weights``)."""
        local = local_moe_weights(
            tensors, self.config, self.layer_index, ep_rank=self.ep_rank, ep_size=self.ep_size
        )
        for name, value in local.items():
            getattr(self, name).copy_(value)

    def hf_weights(self) -> dict[str, Tensor]:
        """The whole layer under HF names on every rank (``gather_moe_weights``)."""
        return gather_moe_weights(self)
