"""DeepSeek-V3 / GLM-4.x-MoE routing and MoE block: group-limited sigmoid top-k, ungated shared experts.

What ``DeepseekV3MoE`` / ``Glm4MoeLiteMoE`` (transformers 5) compute, per token::

    s        = sigmoid(x @ gate.T)                                [E]  (router in fp32)
    choice   = s + e_score_correction_bias                        selection only
    groups   = top topk_group of n_group groups by (sum of the group's 2 largest choice)
    ids      = top k of choice within the chosen groups
    w        = s[ids] / sum(s[ids])  (norm_topk_prob)  * routed_scaling_factor
    y        = shared(x) + sum_j w_j * expert_{ids_j}(x)

Routing goes through the decoder's own ``_model.moe_routing`` (the Inkling sigmoid router
with an expert bias): the group limit is a per-token bias of ``-inf`` on the experts of the
groups not chosen, added to ``e_score_correction_bias``, and ``moe_routing`` does the rest
(stable descending sort so ties go to the lower id, ids ascending, ``norm_topk_prob``,
``routed_scaling_factor``). It is given a routing view of the config
(``routing_view``): sigmoid scores, no gated shared experts, because DeepSeek's shared
experts have no router row and always weigh 1.

Departures from transformers (G5 of the design note), all within tolerance of its output:
groups are ranked by a stable sort, so a tie goes to the lower group id (transformers'
``topk(sorted=False)`` leaves it to the kernel); the experts are combined in a fixed fp32
order, the shared output first and then the routed ones by ascending id (transformers adds
the routed ones by ascending id into zeros, then the shared output); the ``+ 1e-20`` in
transformers' normaliser is not added (it changes an fp32 sum of the chosen sigmoids only
when that sum is below about 1e-13, i.e. every chosen logit below about -30).

``n_shared_experts = S`` shared experts are one SwiGLU MLP of width ``S *
moe_intermediate_size``, as transformers and SGLang build them (``shared_fc1 = [gate; up]``).

**Layer layout** (``mlp_layer_types``): DeepSeek-V3's layer ``i`` is MoE when ``i >=
first_k_dense_replace`` (transformers 5 reads nothing else; the original code and SGLang also
require ``i % moe_layer_freq == 0``, so any ``moe_layer_freq`` other than 1 is refused rather
than read two ways). GLM-4.x-Lite reads ``mlp_layer_types`` (``"dense"``/``"sparse"``, default
dense first then sparse); SGLang reads ``first_k_dense_replace`` for it, so a config holding
both must agree. On the decoder the result maps onto its existing switches:
``mlp_only_layers`` = the dense indices with ``decoder_sparse_step = 1``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.models._config import ModelConfig
from posttrain.models._errors import (
    MissingTensorError,
    ModelConfigError,
    TensorSpecMismatchError,
    UnknownTensorError,
)
from posttrain.models._mla_config import config_int
from posttrain.models._model import moe_routing
from posttrain.models._ops import FastOps


@dataclass(kw_only=True, slots=True, frozen=True)
class DeepseekMoeSpec:
    """A DeepSeek-style MoE block (transformers' field names)."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "moe_intermediate_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(
                    f"DeepseekMoeSpec.{name} must be a positive int, got {value!r}"
                )
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ModelConfigError(
                f"DeepseekMoeSpec.n_shared_experts must be an int >= 0, got {self.n_shared_experts!r}"
            )
        e, g = self.n_routed_experts, self.n_group
        if e % g:
            raise ModelConfigError(
                f"DeepseekMoeSpec.n_routed_experts={e} is not a multiple of n_group={g}"
            )
        if g > 1 and e // g < 2:
            raise ModelConfigError(
                f"DeepseekMoeSpec: n_group={g} leaves {e // g} expert per group; a group's "
                "score is the sum of its 2 best experts"
            )
        if self.topk_group > g:
            raise ModelConfigError(
                f"DeepseekMoeSpec.topk_group={self.topk_group} exceeds n_group={g}"
            )
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise ModelConfigError(
                f"DeepseekMoeSpec.num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                f"{self.topk_group * (e // g)} experts of topk_group={self.topk_group} groups"
            )
        factor = self.routed_scaling_factor
        if (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not (math.isfinite(factor) and factor > 0)
        ):
            raise ModelConfigError(
                f"DeepseekMoeSpec.routed_scaling_factor must be a finite number > 0, got {factor!r}"
            )

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> DeepseekMoeSpec:
        """Read a ``DeepseekV3Config`` / ``Glm4MoeLiteConfig`` ``config.json``.

        ``scoring_func`` (if present) must be ``sigmoid`` and ``topk_method`` ``noaux_tc``:
        DeepSeek-V2's softmax and greedy methods are refused by name; ``hidden_act`` must be
        ``silu``. ``n_group`` / ``topk_group`` of None mean one group (transformers' GLM
        default).
        """
        for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            value = hf.get(key, allowed)
            if value != allowed:
                raise ModelConfigError(
                    f"config.json: {key}={value!r} is not supported (DeepSeek-V3-style "
                    f"routing needs {key}={allowed!r})"
                )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"config.json: hidden_act={act!r} is not supported (silu only)")
        experts = "n_routed_experts" if "n_routed_experts" in hf else "num_local_experts"
        return cls(
            hidden_size=config_int(hf, "hidden_size"),
            moe_intermediate_size=config_int(hf, "moe_intermediate_size"),
            n_routed_experts=config_int(hf, experts),
            num_experts_per_tok=config_int(hf, "num_experts_per_tok"),
            n_shared_experts=hf.get("n_shared_experts", 1),
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        )

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the (fused) shared-expert MLP: ``n_shared_experts * moe_intermediate_size``."""
        return self.n_shared_experts * self.moe_intermediate_size


@functools.lru_cache(maxsize=64)
def routing_view(spec: DeepseekMoeSpec) -> ModelConfig:
    """The config ``moe_routing`` reads for ``spec``: its routing fields, sigmoid scores, no
    gated shared experts. ``moe_routing`` reads nothing else; the remaining required
    ``ModelConfig`` fields are the smallest valid values (the decoder's own config takes
    this role once the decoder builds DeepSeek-style layers)."""
    return ModelConfig(
        vocab_size=1,
        hidden_size=spec.hidden_size,
        intermediate_size=1,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=spec.norm_topk_prob,
        router_score_function="sigmoid",
        routed_scaling_factor=float(spec.routed_scaling_factor),
    )


def group_limit_bias(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """``[T, E]``: 0 on the experts of each token's ``topk_group`` best groups, ``-inf`` elsewhere.

    ``choice[T, E]`` are the selection scores (sigmoid + correction bias). A group's score is
    the sum of its two largest choices; groups are ranked by a stable descending sort, so a
    tie goes to the lower group id.
    """
    t, e = choice.shape
    if topk_group >= n_group:
        return choice.new_zeros(t, e)
    grouped = choice.reshape(t, n_group, e // n_group)
    best = grouped.topk(2, dim=-1).values
    group_scores = best[..., 0] + best[..., 1]
    chosen = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device)
    keep = keep.scatter(1, chosen, True)
    bias = torch.where(keep, 0.0, float("-inf")).to(choice.dtype)
    return bias[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)


def group_limited_routing(
    ops: type[FastOps], spec: DeepseekMoeSpec, logits: Tensor, correction_bias: Tensor
) -> tuple[Tensor, Tensor]:
    """``(ids [T, k] ascending, weights [T, k])`` of DeepSeek-V3 routing from ``logits[T, E]``."""
    choice = ops.sigmoid(logits.detach()) + correction_bias.float()
    bias = correction_bias.float() + group_limit_bias(choice, spec.n_group, spec.topk_group)
    return moe_routing(ops, routing_view(spec), logits, bias)


def swiglu_mlp(ops: type[FastOps], fc1: Tensor, fc2: Tensor, x: Tensor) -> Tensor:
    """``fc2(silu(gate) * up)`` with ``fc1 = [gate; up]`` (``[2I, H]``), ``fc2[H, I]``."""
    i = fc2.shape[1]
    gu = ops.linear(x, fc1)
    return ops.linear(ops.silu_mul(gu[:, :i], gu[:, i:]), fc2)


class DeepseekMoe(nn.Module):
    """One DeepSeek-style MoE block: ``router[E, H]`` and ``expert_bias[E]`` (both fp32, as
    transformers keeps them), ``experts_fc1[E, 2I, H]``, ``experts_fc2[E, H, I]``, and with
    shared experts ``shared_fc1[2 * S * I, H]``, ``shared_fc2[H, S * I]``."""

    router: nn.Parameter
    expert_bias: nn.Parameter
    experts_fc1: nn.Parameter
    experts_fc2: nn.Parameter
    shared_fc1: nn.Parameter
    shared_fc2: nn.Parameter

    def __init__(self, spec: DeepseekMoeSpec, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.n_routed_experts
        self.router = nn.Parameter(torch.zeros(e, h, dtype=torch.float32))
        bias = torch.zeros(e, dtype=torch.float32)
        self.expert_bias = nn.Parameter(bias, requires_grad=False)  # fixed, saved, fp32
        self.experts_fc1 = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dtype))
        self.experts_fc2 = nn.Parameter(torch.zeros(e, h, i, dtype=dtype))
        si = spec.shared_intermediate_size
        if si:
            self.shared_fc1 = nn.Parameter(torch.zeros(2 * si, h, dtype=dtype))
            self.shared_fc2 = nn.Parameter(torch.zeros(h, si, dtype=dtype))

    def route(self, ops: type[FastOps], x: Tensor) -> tuple[Tensor, Tensor]:
        """``(ids [T, k] ascending, weights [T, k])`` for ``x[T, H]``."""
        return group_limited_routing(ops, self.spec, ops.linear(x, self.router), self.expert_bias)

    def forward(self, ops: type[FastOps], x: Tensor) -> Tensor:
        """``[T, H]``: the shared output, then the routed experts by ascending id (G5)."""
        ids, weights = self.route(ops, x)
        outputs = x.new_zeros(x.shape[0], ids.shape[1], x.shape[1])
        for j in torch.unique(ids).tolist():
            tok, slot = (ids == j).nonzero(as_tuple=True)
            y = swiglu_mlp(ops, self.experts_fc1[j], self.experts_fc2[j], x[tok])
            outputs = outputs.index_put((tok, slot), y)
        if not self.spec.n_shared_experts:
            return ops.moe_combine(weights, outputs)
        shared = swiglu_mlp(ops, self.shared_fc1, self.shared_fc2, x)
        ones = weights.new_ones(weights.shape[0], 1)
        return ops.moe_combine(
            torch.cat([ones, weights], dim=1), torch.cat([shared[:, None], outputs], dim=1)
        )

    # ------------------------------------------------------------------ weights

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The weights under transformers 5's in-memory MoE names (``gate.weight``,
        ``gate.e_score_correction_bias``, fused ``experts.gate_up_proj`` / ``down_proj``,
        ``shared_experts.{gate,up,down}_proj.weight``)."""
        out: dict[str, Tensor] = {
            "gate.weight": self.router,
            "gate.e_score_correction_bias": self.expert_bias,
            "experts.gate_up_proj": self.experts_fc1,
            "experts.down_proj": self.experts_fc2,
        }
        si = self.spec.shared_intermediate_size
        if si:
            out["shared_experts.gate_proj.weight"] = self.shared_fc1[:si]
            out["shared_experts.up_proj.weight"] = self.shared_fc1[si:]
            out["shared_experts.down_proj.weight"] = self.shared_fc2
        return out

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy in a ``DeepseekV3MoE`` / ``Glm4MoeLiteMoE`` ``state_dict()`` (exact names,
        shapes and dtypes; nothing is copied unless all of them fit)."""
        own = self.hf_state_dict()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise UnknownTensorError(f"DeepSeek MoE block has no tensor {unknown[0]!r}")
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise MissingTensorError(f"DeepSeek MoE tensor {missing[0]!r} was not given")
        for name, value in tensors.items():
            want = own[name]
            if value.shape != want.shape or value.dtype != want.dtype:
                raise TensorSpecMismatchError(
                    f"DeepSeek MoE tensor {name!r} is {value.dtype} {list(value.shape)}, "
                    f"expected {want.dtype} {list(want.shape)}"
                )
        for name, value in tensors.items():
            own[name].copy_(value)


def mlp_layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """``"dense"`` / ``"moe"`` per layer of a DeepSeek-V3 or GLM-4.x-Lite ``config.json``
    (see the module doc); refuses what transformers and SGLang would read differently."""
    layers = hf.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        raise ModelConfigError(f"config.json: num_hidden_layers={layers!r} must be a positive int")
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        raise ModelConfigError(
            f"config.json: moe_layer_freq={freq!r} is not supported (transformers ignores it, "
            "SGLang honours it; only 1 reads the same in both)"
        )
    if not hf.get("n_routed_experts", hf.get("num_local_experts")):
        return ("dense",) * layers
    model_type = hf.get("model_type")
    first_k = hf.get("first_k_dense_replace")
    if model_type == "deepseek_v3":
        k = 3 if first_k is None else first_k  # DeepseekV3Config's default
        return tuple("moe" if i >= k else "dense" for i in range(layers))
    if model_type != "glm4_moe_lite":
        raise ModelConfigError(
            f"config.json: model_type={model_type!r} has no DeepSeek-style layer layout "
            "(deepseek_v3 or glm4_moe_lite)"
        )
    named = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(named) != layers or any(t not in ("dense", "sparse") for t in named):
        raise ModelConfigError(
            f"config.json: mlp_layer_types={named!r} must name 'dense' or 'sparse' for each "
            f"of the {layers} layers"
        )
    types = tuple("moe" if t == "sparse" else "dense" for t in named)
    if first_k is not None and types != tuple(
        "moe" if i >= first_k else "dense" for i in range(layers)
    ):
        raise ModelConfigError(
            f"config.json: mlp_layer_types={named!r} disagrees with first_k_dense_replace="
            f"{first_k} (transformers reads the first, SGLang the second)"
        )
    return types
