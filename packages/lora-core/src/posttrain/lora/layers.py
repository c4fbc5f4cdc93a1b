"""``LoraLinear``: a base linear plus the rank-r LoRA branch, for every TP layout.

The LoRA forward is ``posttrain.formats.lora_delta`` (the op the engines' adapter hook in
``posttrain.models`` computes too), in this exact order:

    h = linear(x, A)                        # [tokens(_loc), r]  (dropout on x first, opt-in)
    h = R(h)                                # the rank-r reduction of the layout, see below
    y = base(x) + (linear(h, B) * scaling).to(base_y.dtype)

``linear`` is the base layer's own kernel when it declares one (``base.linear_kernel``, as
``posttrain.models``' linear sites do: strict fp32 kernels, so the trainer's LoRA forward is
bit-identical to the engine's), else ``x.to(A.dtype) @ A.T``.

``R`` sits on the rank-r activation between A and B:

* column (W split on out; A replicated ``[r, in]``, B ``[out/tp, r]``): ``copy_to_group`` —
  identity forward, all-reduce SUM of ``d h`` backward, so the branch's input grad is complete
  and replicated with or without sequence parallelism. With SP: ``gather_from_seq`` (all-gather
  ``[tokens/tp, r]``, reduce-scatter backward); A's grad is then token-partial (SUM over TP).
* row (W split on in; A ``[r, in/tp]``, B replicated ``[out, r]``): ``reduce_from_group``
  (all-reduce of the partial ``h``); with SP ``scatter_to_seq`` (reduce-scatter to tokens/tp);
  B's grad is then token-partial (SUM over TP).
* replicated (plain ``nn.Linear``): identity.

Every collective moves ``tokens * r`` elements, not ``tokens * hidden``. Departure from systems
that feed the column branch the raw input and only sum A's grad: there the branch's input grad
stays rank-partial without SP (wrong upstream grads, drifting replicas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from posttrain.formats import LinearKernel, lora_delta, matmul_kernel
from posttrain.lora.comm import copy_to_group, gather_from_seq, reduce_from_group, scatter_to_seq
from posttrain.lora.config import LoraConfig

Layout = Literal["replicated", "column", "row"]


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraParamTag:
    """What a LoRA factor is, so optimizers, grad norms and reductions can treat it right.

    ``shard_axis``: the group the factor is split over (``"tp"``, ``"ep"`` or ``None`` when
    replicated); ``shard_dim``: the tensor dim split. ``tp_partial`` / ``ep_partial``: each rank
    holds a token-partial grad that must be SUMmed over that group. ``expert``: reduced over the
    expert-data-parallel group instead of the data-parallel group.
    """

    site: str
    factor: Literal["A", "B"]
    shard_axis: Literal["tp", "ep"] | None
    shard_dim: int | None
    tp_partial: bool = False
    ep_partial: bool = False
    expert: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class SiteInfo:
    """Static description of one adapted module, enough to export and re-shard its factors.

    ``parts``: the PEFT module paths this site's output is made of and their full output sizes
    (one entry unless fused); ``groups``: the interleave group count of a fused output (``None``:
    one group per TP rank, i.e. each part is sharded alone, the gate/up layout).
    """

    path: str
    layout: Layout
    sequence_parallel: bool
    in_features: int
    out_features: int
    parts: tuple[tuple[str, int], ...]
    groups: int | None = None
    unpadded_out: int | None = None


def tag_parameter(p: nn.Parameter, tag: LoraParamTag) -> None:
    """Attach ``tag`` and the attributes Megatron's optimizer / DDP / grad-norm read."""
    p.lora_tag = tag  # type: ignore[attr-defined]
    tp_sharded = tag.shard_axis == "tp"
    p.tensor_model_parallel = tp_sharded  # type: ignore[attr-defined]
    p.partition_dim = tag.shard_dim if tp_sharded else -1  # type: ignore[attr-defined]
    p.partition_stride = 1  # type: ignore[attr-defined]
    p.sequence_parallel = tag.tp_partial  # type: ignore[attr-defined]
    p.allreduce = not tag.expert  # type: ignore[attr-defined]


class LoraLinear(nn.Module):
    """A base linear (``nn.Linear``, TP-sharded, or megatron-core) wrapped with LoRA factors."""

    def __init__(
        self,
        base: nn.Module,
        *,
        site: SiteInfo,
        config: LoraConfig,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        tp_group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.base = base
        self.site = site
        self.scaling = config.scaling
        self.dropout = config.dropout
        self.tp_group = tp_group
        self.merged = False
        self.enabled = True
        self.lora_A = nn.Parameter(lora_a.to(config.param_dtype).contiguous())
        self.lora_B = nn.Parameter(lora_b.to(config.param_dtype).contiguous())

    @property
    def kernel(self) -> LinearKernel:
        """The base layer's ``linear(x, w)`` if it declares one, else ``matmul_kernel``."""
        declared: LinearKernel | None = getattr(self.base, "linear_kernel", None)
        return declared if declared is not None else matmul_kernel

    def _reduce(self, h: torch.Tensor) -> torch.Tensor:
        sp = self.site.sequence_parallel
        if self.site.layout == "column":
            return gather_from_seq(h, self.tp_group) if sp else copy_to_group(h, self.tp_group)
        if self.site.layout == "row":
            return scatter_to_seq(h, self.tp_group) if sp else reduce_from_group(h, self.tp_group)
        return h

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(R(linear(x, A)), B) * scaling`` (see the module docstring)."""
        if self.dropout > 0.0 and self.training:
            x = F.dropout(x.to(self.lora_A.dtype), p=self.dropout, training=True)
        return lora_delta(
            x, self.lora_A, self.lora_B, self.scaling, linear=self.kernel, reduce=self._reduce
        )

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = self.base(x, *args, **kwargs)
        if self.merged or not self.enabled:
            return out
        if isinstance(out, tuple):  # megatron-core layers return (output, bias)
            y = out[0]
            return (y + self.lora_delta(x).to(y.dtype), *out[1:])
        return out + self.lora_delta(x).to(out.dtype)

    def merge(self) -> None:
        """Fold ``scaling * B @ A`` into the local base weight (fp32; local, no comms)."""
        if self.merged:
            return
        weight = self.base.weight
        assert isinstance(weight, torch.Tensor)
        with torch.no_grad():
            delta = (self.lora_B.float() @ self.lora_A.float()) * self.scaling
            weight.copy_((weight.float() + delta).to(weight.dtype))
        self.merged = True
