"""Plain-torch tensor-parallel linears (Megatron's split, with process groups passed in).

``ColumnShardedLinear`` splits W on the output dim and returns the local output slice
(Megatron's ``gather_output=False``); ``RowShardedLinear`` splits W on the input dim and takes a
TP-sharded input (``input_is_parallel=True``). With ``sequence_parallel`` the activations outside
the pair are sharded along dim 0 (tokens): the column layer all-gathers its input and the row layer
reduce-scatters its output. They exist so LoRA's TP rules can be tested and used without
megatron-core; ``attach_lora`` adapts them and megatron-core's layers by the same rules.

``from_full`` builds a shard from a full ``nn.Linear``; ``split_sizes`` describes a fused column
weight whose parts are sharded separately (gate/up: each rank holds ``[gate_loc; up_loc]``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from posttrain.lora._errors import LayoutError
from posttrain.lora.comm import (
    copy_to_group,
    gather_from_seq,
    group_rank,
    group_size,
    reduce_from_group,
    scatter_to_seq,
)


def _shard(t: torch.Tensor, dim: int, rank: int, size: int, what: str) -> torch.Tensor:
    if t.shape[dim] % size:
        raise LayoutError(f"{what}: dim {dim} of size {t.shape[dim]} not divisible by TP {size}")
    return t.chunk(size, dim=dim)[rank].clone()


class ColumnShardedLinear(nn.Module):
    """``y_loc = x @ W_loc.T (+ b_loc)`` with W split on the output dim over ``tp_group``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool = False,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp = group_size(tp_group)
        if out_features % tp:
            raise LayoutError(f"ColumnShardedLinear: out_features {out_features} % TP {tp} != 0")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(
            torch.zeros(out_features // tp, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features // tp, dtype=dtype, device=device))
            if bias
            else None
        )

    @classmethod
    def from_full(
        cls,
        linear: nn.Linear,
        *,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool = False,
        split_sizes: Sequence[int] | None = None,
    ) -> ColumnShardedLinear:
        """The local shard of ``linear`` (``split_sizes``: fused parts, each sharded alone)."""
        rank, tp = group_rank(tp_group), group_size(tp_group)
        mod = cls(
            linear.in_features,
            linear.out_features,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,  # the shard lives where the full layer does
        )
        sizes = list(split_sizes) if split_sizes else [linear.out_features]
        if sum(sizes) != linear.out_features:
            raise LayoutError(f"split_sizes {sizes} do not add up to {linear.out_features}")
        with torch.no_grad():
            w_parts = torch.split(linear.weight, sizes, dim=0)
            mod.weight.copy_(torch.cat([_shard(p, 0, rank, tp, "weight") for p in w_parts]))
            if linear.bias is not None and mod.bias is not None:
                b_parts = torch.split(linear.bias, sizes, dim=0)
                mod.bias.copy_(torch.cat([_shard(p, 0, rank, tp, "bias") for p in b_parts]))
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_seq(x, self.tp_group)
        else:
            x = copy_to_group(x, self.tp_group)
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class RowShardedLinear(nn.Module):
    """``y = reduce(x_loc @ W_loc.T) (+ b)`` with W split on the input dim over ``tp_group``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: ProcessGroup | None,
        sequence_parallel: bool = False,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tp = group_size(tp_group)
        if in_features % tp:
            raise LayoutError(f"RowShardedLinear: in_features {in_features} % TP {tp} != 0")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features // tp, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )
        if self.bias is not None and sequence_parallel:
            # Each rank adds the bias to its own tokens: its grad is token-partial.
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]

    @classmethod
    def from_full(
        cls, linear: nn.Linear, *, tp_group: ProcessGroup | None, sequence_parallel: bool = False
    ) -> RowShardedLinear:
        """The local shard of ``linear``."""
        rank, tp = group_rank(tp_group), group_size(tp_group)
        mod = cls(
            linear.in_features,
            linear.out_features,
            tp_group=tp_group,
            sequence_parallel=sequence_parallel,
            bias=linear.bias is not None,
            dtype=linear.weight.dtype,
            device=linear.weight.device,  # the shard lives where the full layer does
        )
        with torch.no_grad():
            mod.weight.copy_(_shard(linear.weight, 1, rank, tp, "weight"))
            if linear.bias is not None and mod.bias is not None:
                mod.bias.copy_(linear.bias)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T
        y = (
            scatter_to_seq(y, self.tp_group)
            if self.sequence_parallel
            else reduce_from_group(y, self.tp_group)
        )
        return y if self.bias is None else y + self.bias
