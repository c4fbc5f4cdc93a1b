"""Expert parallelism (EP) for the MoE layers of a ``posttrain.models`` decoder, on any backend.

``ExpertParallelMoe`` is one MoE layer of a ``ModelConfig`` (softmax or sigmoid router with its
fixed expert bias, ``norm_topk_prob``, ``routed_scaling_factor``, optional shared experts) whose
routed experts are split over an expert-parallel process group: EP rank ``r`` of ``ep`` holds
experts ``[r * E / ep, (r + 1) * E / ep)``. Its ``forward(m)`` is ``DecoderModel._moe`` for the
post-norm hidden states ``m [T, H]`` of this rank.

Why our own dispatch, not megatron-core's ``MoELayer``
------------------------------------------------------
megatron-core 0.16.1's MoE layer does not run on CPU with gloo: its all-to-all token dispatcher
creates a ``torch.cuda.Stream`` when it is built, its router moves its weight to
``torch.cuda.current_device()`` on the first forward, and the layer takes its groups from
megatron's global ``parallel_state``. It also computes with its own kernels (grouped GEMM, its
own top-k, softmax and un-permute order), so strict numerics (the engine's bits) could not hold.
So tokens are dispatched here with explicit all-to-alls over explicit groups, and every expert
runs the model's own kernels (``StrictOps.linear``, ``silu_mul``, ``moe_combine``).

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
  (Megatron-LM instead requires sequence parallel for MoE with TP > 1). Either way each token
  is routed once per TP group, so no expert sees a token twice.
* The router and the shared experts are replicated on every rank (Megatron TP-shards its
  shared experts; ours are small and stay whole). They see only this rank's tokens, so with
  TP > 1 their grads are partial sums over TP, marked ``sequence_parallel`` as Megatron marks
  its router.

Numerics: each routed row is computed alone by the model's row-independent kernels and the
combine order is the single-process one, so in strict numerics the layer's output is bitwise
equal to ``DecoderModel._moe`` on the same tokens (with or without LoRA). Gradients are equal
to a relative L2 of ~1e-7: an expert's weight grad sums its tokens in another order, and the
DP/EP reductions add partial grads.

Autograd: ``_AllToAll``'s backward is the reverse all-to-all. Every rank of a group must run
each collective's backward even when it routed or received no token, so both all-to-alls take
an *anchor* (a trainable parameter of the layer, making their outputs require grad on every
rank) and the return all-to-all is *tied* to the dispatch's output (a zero gradient), so the
dispatch's backward always runs after it. Grad mode and trainability must agree across ranks.

Gradient rule (``reduce_expert_parallel_grads``; the caller's own DP reduction must skip these
parameters): router and shared-expert parameters (and their LoRA factors) SUM over TP when
TP > 1, then MEAN over DP; routed-expert parameters (local to their owner; no reduction across
EP ranks, which hold different experts) SUM over expert-DP, the replicas of the same experts,
then divide by the DP size (Megatron's expert-grad scaling). The result is the gradient of the
mean of the per-DP-shard losses, as in the single-process model. Parameters carry Megatron's
attributes (``allreduce=False`` on expert parameters, ``sequence_parallel`` on the rest).

LoRA (``attach_lora``): per-expert adapters in the PEFT layout the engine serves
(``model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}``, shared experts, and the
router ``mlp.gate``), each initialised from its PEFT name by ``lora-core``'s
``init_full_factor`` (layout invariant), computed with ``posttrain.formats.lora_delta`` on the
model's kernel. ``export_expert_lora`` all-gathers them over EP into PEFT names on every rank.

Checkpoints: ``local_moe_weights`` takes the HF-named tensors of a checkpoint and returns this
EP rank's slice; ``gather_moe_weights`` all-gathers a layer back to full HF names (bitwise
copies), so a checkpoint saved under one EP size loads under any other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from posttrain.formats import PeftFormatError, lora_delta, peft_key, peft_modules
from posttrain.grpo._errors import GrpoConfigError, GrpoInputError
from posttrain.lora import LoraConfig
from posttrain.lora.config import init_full_factor
from posttrain.models import FastOps, ModelConfig, Numerics, StrictOps

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


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertParallelGroups:
    """The groups of one rank; ``None`` is an axis of size 1 (never the world by default).

    ``ep``: experts split over it. ``expert_dp``: ranks holding the same experts. ``dp``: the
    dense data-parallel group (its size divides every grad, see the module doc). ``tp``: the
    tensor-parallel group; ``sequence_parallel`` says whether its ranks hold different tokens
    (True) or the same tokens (False: the layer splits them, see the module doc).
    """

    ep: ProcessGroup | None = None
    expert_dp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    tp: ProcessGroup | None = None
    sequence_parallel: bool = False


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


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _check_member(group: ProcessGroup | None, field: str) -> None:
    if group is not None and dist.get_rank(group) < 0:
        raise GrpoConfigError(
            f"rank {dist.get_rank()} is not a member of ExpertParallelGroups.{field}", field=field
        )


# --------------------------------------------------------------------------- collectives


def _all_to_all(x: Tensor, send: list[int], recv: list[int], group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _all_gather_rows(x: Tensor, sizes: list[int], group: ProcessGroup) -> Tensor:
    """All-gather rows of varying count (``sizes[r]`` from rank ``r``) as one all-to-all."""
    n = len(sizes)
    return _all_to_all(torch.cat([x] * n), [x.shape[0]] * n, sizes, group)


def _all_gather_flat(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.new_empty((_size(group) * x.numel(),))
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x.contiguous().reshape(-1), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``send[r]`` to rank ``r``; backward: the reverse all-to-all (see the module doc
    for ``anchor`` and ``tie``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        send: list[int],
        recv: list[int],
        group: ProcessGroup,
        anchor: Tensor | None,
        tie: Tensor | None,
    ) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.tie = None if tie is None else (tie.shape, tie.dtype, tie.device)
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        back = _all_to_all(grad, ctx.recv, ctx.send, ctx.group)
        tie = None
        if ctx.tie is not None and ctx.needs_input_grad[5]:
            shape, dtype, device = ctx.tie
            tie = torch.zeros(shape, dtype=dtype, device=device)
        return back, None, None, None, None, tie


class _TakeShare(torch.autograd.Function):
    """Forward: this TP rank's rows of replicated tokens; backward: all-gather the row grads
    (each rank computed only its share's contribution to the replicated input)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, sizes: list[int], group: ProcessGroup, anchor: Tensor | None
    ) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        me = dist.get_rank(group)
        start = sum(sizes[:me])
        return x[start : start + sizes[me]].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _all_gather_rows(grad, ctx.sizes, ctx.group), None, None, None


class _GatherShares(torch.autograd.Function):
    """Forward: all-gather the TP shares' outputs; backward: this rank's rows of the grad (the
    grad of a replicated activation is whole and equal on every TP rank)."""

    @staticmethod
    def forward(
        ctx: Any, y: Tensor, sizes: list[int], group: ProcessGroup, anchor: Tensor | None
    ) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(y, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        me = dist.get_rank(ctx.group)
        start = sum(ctx.sizes[:me])
        return grad[start : start + ctx.sizes[me]].clone(), None, None, None


def _inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


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
        self.numerics = Numerics(numerics)
        self.ep_size, self.ep_rank = _size(groups.ep), _rank(groups.ep)
        e, ns = config.num_experts, config.n_shared_experts
        if e % self.ep_size:
            raise GrpoConfigError(
                f"num_experts={e} of layer {layer_index} is not divisible by the size "
                f"{self.ep_size} of ExpertParallelGroups.ep",
                field="num_experts",
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

        self.router = nn.Parameter(zeros(e + ns, h))
        if config.router_score_function == "sigmoid":
            self.expert_bias = nn.Parameter(zeros(e, dtype=torch.float32), requires_grad=False)
        self.experts_fc1 = nn.Parameter(zeros(n, 2 * i, h))
        self.experts_fc2 = nn.Parameter(zeros(n, h, i))
        if ns:
            self.shared_fc1 = nn.Parameter(zeros(ns, 2 * si, h))
            self.shared_fc2 = nn.Parameter(zeros(ns, h, si))
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.lora_config: LoraConfig | None = None
        self.lora_enabled = True
        for name, param in self.named_parameters():
            self._mark(name, param)
        self._check_expert_dp()

    @property
    def ops(self) -> type[FastOps]:
        return StrictOps if self.numerics is Numerics.STRICT else FastOps

    def is_expert_parameter(self, name: str) -> bool:
        """Whether parameter ``name`` belongs to the local routed experts (EP-sharded)."""
        return name.startswith(("experts_", "lora_A.experts_", "lora_B.experts_"))

    def _mark(self, name: str, param: nn.Parameter) -> None:
        # Megatron's DDP / finalize_model_grads read these (see the module doc).
        expert = self.is_expert_parameter(name)
        param.allreduce = not expert  # type: ignore[attr-defined]
        param.sequence_parallel = not expert and _size(self.groups.tp) > 1  # type: ignore[attr-defined]
        param.tensor_model_parallel = False  # type: ignore[attr-defined]

    def _check_expert_dp(self) -> None:
        group = self.groups.expert_dp
        if _size(group) == 1:
            return
        assert group is not None
        mine = torch.tensor([self.ep_rank], dtype=torch.long, device=self.router.device)
        peers = _all_gather_flat(mine, group)
        if bool((peers != mine).any()):
            raise GrpoConfigError(
                f"ExpertParallelGroups.expert_dp of rank {dist.get_rank()} joins EP ranks "
                f"{peers.tolist()}: its members must hold the same experts (one EP rank)",
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
        if tp is None or _size(tp) == 1 or self.groups.sequence_parallel:
            return self._moe(m, anchor)
        n, parts = m.shape[0], _size(tp)
        sizes = [n // parts + (1 if r < n % parts else 0) for r in range(parts)]
        share: Tensor = _TakeShare.apply(m, sizes, tp, anchor)  # type: ignore[no-untyped-call]
        y = self._moe(share, anchor)
        out: Tensor = _GatherShares.apply(y, sizes, tp, anchor)  # type: ignore[no-untyped-call]
        return out

    def _moe(self, x: Tensor, anchor: Tensor | None) -> Tensor:
        cfg, ops = self.config, self.ops
        k, e, ns = cfg.num_experts_per_tok, cfg.num_experts, cfg.n_shared_experts
        logits = self._with_lora(x, ops.linear(x, self.router), "gate", 0)
        if cfg.router_score_function == "sigmoid":
            scores = ops.sigmoid(logits)
            select = scores[:, :e].detach() + self.expert_bias.float()
        else:
            scores = ops.softmax(logits)
            select = scores.detach()
        # as DecoderModel._moe: stable top-k (ties to the lower id), then ids ascending
        top = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
        ids = torch.sort(top, dim=-1).values
        weights = scores[:, :e].gather(1, ids)
        if ns:
            weights = torch.cat([scores[:, e:], weights], dim=1)
            weights = weights / ops.sum_last(weights)[:, None]
        elif cfg.norm_topk_prob:
            weights = weights / ops.sum_last(weights)[:, None]
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        outputs = self._routed(x, ids, anchor)
        if ns:
            shared = [
                self._expert(x, self.shared_fc1[s], self.shared_fc2[s], "shared_experts", s)
                for s in range(ns)
            ]
            outputs = torch.cat([torch.stack(shared, dim=1), outputs], dim=1)
        return ops.moe_combine(weights, outputs)

    def _routed(self, x: Tensor, ids: Tensor, anchor: Tensor | None) -> Tensor:
        """``[T, k, H]``: slot ``s`` of token ``t`` holds expert ``ids[t, s]``'s output."""
        t, k = ids.shape
        h, e, n, ep = (
            self.config.hidden_size,
            self.config.num_experts,
            self.num_local_experts,
            (self.ep_size),
        )
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # assignments grouped by expert
        x_send = x[order // k]
        per_expert = torch.bincount(flat, minlength=e)
        group = self.groups.ep
        if group is None or ep == 1:
            recv_counts, x_recv = per_expert.view(1, n), x_send
        else:
            recv_flat = torch.empty_like(per_expert)
            dist.all_to_all_single(recv_flat, per_expert, group=group)
            recv_counts = recv_flat.view(ep, n)  # [source rank, local expert]
            send = per_expert.view(ep, n).sum(1).tolist()
            recv = recv_counts.sum(1).tolist()
            x_recv = _AllToAll.apply(x_send, send, recv, group, anchor, None)  # type: ignore[no-untyped-call]
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
        y_recv = (torch.cat(ys) if ys else x_recv.new_zeros((0, h)))[_inverse(by_expert)]
        if group is not None and ep > 1:
            y_recv = _AllToAll.apply(y_recv, recv, send, group, anchor, x_recv)  # type: ignore[no-untyped-call]
        return y_recv[_inverse(order)].reshape(t, k, h)

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
        if key not in self.lora_A or not self.lora_enabled or self.lora_config is None:
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
        return _lora_module(self.prefix, key, index)

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

    @torch.no_grad()
    def load_lora(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy this rank's factors from a full PEFT adapter (other modules are ignored);
        every attached module must be present with matching shapes and finite values."""
        if self.lora_config is None:
            raise GrpoConfigError("load_lora: attach_lora first", field="lora_targets")
        mine = {k: v for k, v in tensors.items() if self.prefix in k}
        try:
            modules = peft_modules(mine, where=f"adapter (MoE layer {self.layer_index})")
        except PeftFormatError as err:
            raise GrpoInputError(str(err)) from err
        for key in self.lora_A:
            a_p, b_p = self.lora_A[key], self.lora_B[key]
            count = a_p.shape[0] if a_p.ndim == 3 else 0
            for j in range(max(count, 1)):
                name = self.lora_module_name(key, j)
                if name not in modules:
                    raise GrpoInputError(f"adapter has no LoRA factors for module {name!r}")
                a, b = modules[name]
                dst_a, dst_b = (a_p[j], b_p[j]) if count else (a_p, b_p)
                for factor, src, dst in (("A", a, dst_a), ("B", b, dst_b)):
                    if src.shape != dst.shape:
                        raise GrpoInputError(
                            f"{peft_key(name, factor)} has shape {tuple(src.shape)}, "
                            f"expected {tuple(dst.shape)}"
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


# --------------------------------------------------------------------------- checkpoints


def _check_tensor(name: str, value: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(value.shape) != shape:
        raise GrpoInputError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
    if value.dtype != dtype:
        raise GrpoInputError(
            f"tensor {name!r} has dtype {value.dtype}, expected {dtype} (dtypes are never cast)"
        )
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise GrpoInputError(f"tensor {name!r} holds non-finite values")


def _take(tensors: Mapping[str, Tensor], name: str) -> Tensor:
    if name not in tensors:
        raise GrpoInputError(f"checkpoint tensor {name!r} is missing")
    return tensors[name]


def local_moe_weights(
    tensors: Mapping[str, Tensor],
    config: ModelConfig,
    layer_index: int,
    *,
    ep_rank: int,
    ep_size: int,
) -> dict[str, Tensor]:
    """EP rank ``ep_rank`` of ``ep_size``'s tensors of MoE layer ``layer_index``.

    ``tensors`` are HF-named as a checkpoint holds them (per-expert
    ``...mlp.experts.{e}.{gate,up,down}_proj.weight``, or the stacked ``experts.gate_up_proj`` /
    ``experts.down_proj``); names of other layers are ignored. Returns ``ExpertParallelMoe``
    parameter names: ``router``, ``expert_bias``, ``experts_fc1 [E/ep, 2I, H]``,
    ``experts_fc2``, ``shared_fc1``, ``shared_fc2``. Shapes and dtypes must match the config
    exactly (never cast); values must be finite.
    """
    c = config
    if not 0 <= ep_rank < ep_size or c.num_experts % ep_size:
        raise GrpoConfigError(
            f"ep_rank={ep_rank}, ep_size={ep_size} is not a valid EP slice of "
            f"num_experts={c.num_experts}",
            field="num_experts" if c.num_experts % max(ep_size, 1) else "ep_rank",
        )
    if not 0 <= layer_index < c.num_hidden_layers or not c.is_moe_layer(layer_index):
        raise GrpoConfigError(f"layer_index={layer_index} is not a MoE layer", field="layer_index")
    m, dt = f"model.layers.{layer_index}.mlp.", c.dtype
    h, i, e, ns, si = (
        c.hidden_size,
        c.moe_intermediate_size,
        c.num_experts,
        c.n_shared_experts,
        c.shared_intermediate_size,
    )
    n = e // ep_size
    local = range(ep_rank * n, (ep_rank + 1) * n)
    out: dict[str, Tensor] = {}
    out["router"] = _take(tensors, m + "gate.weight")
    _check_tensor(m + "gate.weight", out["router"], (e + ns, h), dt)
    if c.router_score_function == "sigmoid":
        bias = _take(tensors, m + "gate.e_score_correction_bias")
        _check_tensor(m + "gate.e_score_correction_bias", bias, (e,), torch.float32)
        out["expert_bias"] = bias
    if m + "experts.gate_up_proj" in tensors or m + "experts.down_proj" in tensors:
        fc1, fc2 = (
            _take(tensors, m + "experts.gate_up_proj"),
            _take(tensors, m + "experts.down_proj"),
        )
        _check_tensor(m + "experts.gate_up_proj", fc1, (e, 2 * i, h), dt)
        _check_tensor(m + "experts.down_proj", fc2, (e, h, i), dt)
        out["experts_fc1"], out["experts_fc2"] = (
            fc1[local.start : local.stop],
            fc2[local.start : local.stop],
        )
    else:
        out["experts_fc1"] = _stack_experts(tensors, f"{m}experts", local, (i, h), dt, fused=True)
        out["experts_fc2"] = _stack_experts(tensors, f"{m}experts", local, (h, i), dt, fused=False)
    if ns:
        out["shared_fc1"] = _stack_experts(
            tensors, f"{m}shared_experts", range(ns), (si, h), dt, fused=True
        )
        out["shared_fc2"] = _stack_experts(
            tensors, f"{m}shared_experts", range(ns), (h, si), dt, fused=False
        )
    return out


def _stack_experts(
    tensors: Mapping[str, Tensor],
    container: str,
    experts: range,
    shape: tuple[int, int],
    dtype: torch.dtype,
    *,
    fused: bool,
) -> Tensor:
    parts = ("gate_proj", "up_proj") if fused else ("down_proj",)
    stacked = []
    for j in experts:
        rows = []
        for part in parts:
            name = f"{container}.{j}.{part}.weight"
            rows.append(_take(tensors, name))
            _check_tensor(name, rows[-1], shape, dtype)
        stacked.append(torch.cat(rows) if fused else rows[0])
    return torch.stack(stacked)


def gather_moe_weights(module: ExpertParallelMoe) -> dict[str, Tensor]:
    """The layer's full HF-named tensors on every rank: router (and bias), every routed expert's
    ``gate_proj`` / ``up_proj`` / ``down_proj`` and the shared experts; bitwise copies of the
    parameters (collective over ``ep``)."""
    c, m = module.config, module.prefix
    i = c.moe_intermediate_size
    out: dict[str, Tensor] = {m + "gate.weight": module.router.detach().clone()}
    if c.router_score_function == "sigmoid":
        out[m + "gate.e_score_correction_bias"] = module.expert_bias.detach().clone()
    fc1, fc2 = module.experts_fc1.detach(), module.experts_fc2.detach()
    group = module.groups.ep
    if group is not None and module.ep_size > 1:
        flat = _all_gather_flat(torch.cat([fc1.reshape(-1), fc2.reshape(-1)]), group)
        per_rank, split = flat.view(module.ep_size, -1), fc1.numel()
        fc1 = per_rank[:, :split].reshape(c.num_experts, *fc1.shape[1:])
        fc2 = per_rank[:, split:].reshape(c.num_experts, *fc2.shape[1:])
    for j in range(fc1.shape[0]):
        out[f"{m}experts.{j}.gate_proj.weight"] = fc1[j, :i].clone()
        out[f"{m}experts.{j}.up_proj.weight"] = fc1[j, i:].clone()
        out[f"{m}experts.{j}.down_proj.weight"] = fc2[j].clone()
    for s in range(c.n_shared_experts):
        si = c.shared_intermediate_size
        out[f"{m}shared_experts.{s}.gate_proj.weight"] = module.shared_fc1[s, :si].detach().clone()
        out[f"{m}shared_experts.{s}.up_proj.weight"] = module.shared_fc1[s, si:].detach().clone()
        out[f"{m}shared_experts.{s}.down_proj.weight"] = module.shared_fc2[s].detach().clone()
    return out


def export_expert_lora(
    modules: Sequence[ExpertParallelMoe], *, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The LoRA factors of ``modules`` under PEFT keys, whole on every rank (routed experts
    all-gathered over ``ep``), sorted by key, in ``dtype`` (default: the LoRA config's
    ``export_dtype``); collective over ``ep``."""
    out: dict[str, Tensor] = {}
    for module in modules:
        if module.lora_config is None:
            raise GrpoConfigError(
                f"export_expert_lora: MoE layer {module.layer_index} has no LoRA",
                field="lora_targets",
            )
        factors = {
            (key, f): (module.lora_A if f == "A" else module.lora_B)[key].detach()
            for key in module.lora_A
            for f in ("A", "B")
        }
        routed = [kf for kf in factors if kf[0].startswith("experts_")]  # EP-sharded
        group = module.groups.ep
        if routed and group is not None and module.ep_size > 1:
            local = [factors[kf] for kf in routed]
            flat = _all_gather_flat(torch.cat([t.reshape(-1) for t in local]), group)
            rows = [
                torch.split(row, [t.numel() for t in local])
                for row in flat.view(module.ep_size, -1)
            ]
            for j, (kf, t) in enumerate(zip(routed, local, strict=True)):
                factors[kf] = torch.cat([row[j].view(t.shape) for row in rows])
        for (key, f), value in factors.items():
            if value.ndim == 2:  # the router: one module
                out[peft_key(_lora_module(module.prefix, key, 0), f)] = value
                continue
            for j in range(value.shape[0]):  # global expert id, or shared expert index
                out[peft_key(_lora_module(module.prefix, key, j), f)] = value[j]
    return {k: out[k].to(dtype or _export_dtype(modules)).contiguous().clone() for k in sorted(out)}


def _lora_module(prefix: str, key: str, index: int) -> str:
    """PEFT module of site ``key`` (``gate``, ``experts_<part>``, ``shared_experts_<part>``) for
    global expert (or shared expert) ``index``."""
    if key == "gate":
        return prefix + "gate"
    kind, part = (
        ("shared_experts", key.removeprefix("shared_experts_"))
        if key.startswith("shared_experts_")
        else ("experts", key.removeprefix("experts_"))
    )
    return f"{prefix}{kind}.{index}.{part}"


def _export_dtype(modules: Sequence[ExpertParallelMoe]) -> torch.dtype:
    config = modules[0].lora_config
    assert config is not None
    return config.export_dtype


# --------------------------------------------------------------------------- gradients


def _shared_groups(modules: Sequence[ExpertParallelMoe]) -> ExpertParallelGroups:
    if not modules:
        raise GrpoConfigError("no ExpertParallelMoe modules given")
    groups = modules[0].groups
    if any(mod.groups is not groups for mod in modules):
        raise GrpoConfigError("the ExpertParallelMoe modules must share one ExpertParallelGroups")
    return groups


def _trainable(
    modules: Sequence[ExpertParallelMoe], *, expert: bool
) -> list[tuple[nn.Parameter, Tensor]]:
    out = []
    for module in modules:
        for name, p in module.named_parameters():
            if not p.requires_grad or module.is_expert_parameter(name) != expert:
                continue
            if p.grad is None:  # no token reached it here; a peer may have one: reduce zeros
                p.grad = torch.zeros_like(p)
            out.append((p, p.grad))
    return out


def _all_reduce_into(grads: list[Tensor], group: ProcessGroup | None, scale: float) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    if group is not None and _size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for g, piece in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
        g.copy_(piece.view_as(g))


def reduce_expert_parallel_grads(modules: Sequence[ExpertParallelMoe]) -> None:
    """Reduce the grads of every trainable parameter of ``modules`` in place (the rule of the
    module doc); collective over ``tp``, ``dp`` and ``expert_dp``. The caller's own DP
    reduction must skip these parameters."""
    g = _shared_groups(modules)
    dp = _size(g.dp)
    replicated = [gr for _, gr in _trainable(modules, expert=False)]
    if _size(g.tp) > 1:
        _all_reduce_into(replicated, g.tp, 1.0)
    _all_reduce_into(replicated, g.dp, 1.0 / dp)
    _all_reduce_into([gr for _, gr in _trainable(modules, expert=True)], g.expert_dp, 1.0 / dp)


def expert_parallel_grad_norm_sq(modules: Sequence[ExpertParallelMoe]) -> float:
    """Squared L2 norm of the (reduced) grads of ``modules``: expert grads summed over ``ep``,
    replicated ones counted once; add it to the rest of the model's (collective over ``ep``)."""
    g = _shared_groups(modules)
    replicated = sum(
        (gr.double().pow(2).sum() for _, gr in _trainable(modules, expert=False)),
        torch.zeros((), dtype=torch.float64),
    )
    experts = sum(
        (gr.double().pow(2).sum().cpu() for _, gr in _trainable(modules, expert=True)),
        torch.zeros((), dtype=torch.float64),
    )
    if g.ep is not None and _size(g.ep) > 1:
        device = modules[0].router.device
        box = experts.reshape(1).to(device)
        dist.all_reduce(box, op=dist.ReduceOp.SUM, group=g.ep)
        experts = box.cpu()[0]
    return float(replicated.cpu() + experts)
