"""megatron-core's parallel linears, computing with the decoder's own linear kernel.

``KernelColumnParallelLinear`` / ``KernelRowParallelLinear`` are megatron-core's
``ColumnParallelLinear`` / ``RowParallelLinear`` (same parameters, the same attributes its
optimizer and lora-core read, the same communication: ``copy_to`` / all-reduce of the input
grad, the sequence-parallel all-gather / reduce-scatter, the row all-reduce) with one method
replaced: ``_forward_impl``, the local matmul, runs ``linear_kernel`` (the model's
``StrictOps.linear`` in strict numerics) instead of megatron's fused
``linear_with_grad_accumulation_and_async_allreduce``. So each rank's share of a linear is
bit for bit the rows (column) or the partial sums (row) the single-process model computes; only
the row all-reduce adds partial sums in another order than the single-process kernel.

Why not megatron's own matmul: it is not batch invariant (BLAS), and its sequence-parallel
path (and its token-dim mappings) allocate on ``torch.cuda.current_device()``, which a CPU/gloo
rank lacks: under sequence parallelism the column layer's all-gather and the row layer's
reduce-scatter are ours (``_mappings``, same math, any device); without it megatron's own
``copy_to`` / all-reduce mappings run.

``ParallelSite`` wraps one such layer where the decoder expects a linear site (a module
returning a tensor: megatron's layers return ``(output, bias)``). lora-core's ``attach_lora``
wraps the megatron layer inside it (``<site>.linear``) by its megatron rules.

Importing this module imports megatron-core (about 10 s of CPU the first time).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed", etc.
    warnings.simplefilter("ignore")
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from posttrain.grpo.megatron._mappings import gather_tokens, reduce_scatter_tokens

LinearKernel = Callable[[Tensor, Tensor], Tensor]


def parallel_config(
    *, tp_size: int, sequence_parallel: bool, dtype: torch.dtype
) -> ModelParallelConfig:
    """megatron-core's layer config: weights allocated on the CPU, left uninitialised (the
    checkpoint is copied in), no fused CUDA extensions."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        gradient_accumulation_fusion=False,
    )


def _mark_split(weight: Tensor, *, dim: int) -> None:
    """megatron-core's ``tensor_model_parallel`` / ``partition_dim`` attributes (its optimizer
    and grad-norm code read them); it sets them only when it initialises the weight itself."""
    if not hasattr(weight, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _no_init(weight: Tensor) -> None:
    """megatron's ``init_method``; unused (``perform_initialization=False``)."""


class KernelColumnParallelLinear(ColumnParallelLinear):  # type: ignore[misc]
    """``ColumnParallelLinear`` (``gather_output=False``) whose local matmul is ``linear_kernel``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        config: ModelParallelConfig,
        tp_group: torch.distributed.ProcessGroup | None,
        kernel: Callable[[], LinearKernel],
    ) -> None:
        super().__init__(
            in_features, out_features, config=config, init_method=_no_init, bias=False,
            gather_output=False, tp_group=tp_group,
        )  # fmt: skip
        object.__setattr__(self, "_kernel", kernel)
        _mark_split(self.weight, dim=0)

    @property
    def linear_kernel(self) -> LinearKernel:
        """The owning model's ``linear(x, w) = x @ w.T`` in its current numerics."""
        kernel: LinearKernel = self._kernel()
        return kernel

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        x = input
        group = kwargs.get("tp_group")
        if kwargs.get("sequence_parallel"):  # all-gather tokens; backward reduce-scatters
            x = gather_tokens(x, group)
        elif kwargs.get("allreduce_dgrad"):  # identity; backward all-reduces the input grad
            x = copy_to_tensor_model_parallel_region(x, group=group)
        y = self.linear_kernel(x, weight)
        bias = kwargs.get("bias")
        return y if bias is None else y + bias


class KernelRowParallelLinear(RowParallelLinear):  # type: ignore[misc]
    """``RowParallelLinear`` (``input_is_parallel=True``) whose local matmul is ``linear_kernel``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        config: ModelParallelConfig,
        tp_group: torch.distributed.ProcessGroup | None,
        kernel: Callable[[], LinearKernel],
    ) -> None:
        super().__init__(
            in_features, out_features, config=config, init_method=_no_init, bias=False,
            input_is_parallel=True, skip_bias_add=False, tp_group=tp_group,
        )  # fmt: skip
        object.__setattr__(self, "_kernel", kernel)
        _mark_split(self.weight, dim=1)

    @property
    def linear_kernel(self) -> LinearKernel:
        """The owning model's ``linear(x, w) = x @ w.T`` in its current numerics."""
        kernel: LinearKernel = self._kernel()
        return kernel

    def _forward_impl(self, input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # megatron all-reduces the partial output after this returns
        return self.linear_kernel(input, weight)

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        if not self.sequence_parallel:
            out: tuple[Tensor, Tensor | None] = super().forward(input_)
            return out
        # megatron's reduce-scatter allocates on torch.cuda.current_device(): ours (_mappings)
        return reduce_scatter_tokens(self.linear_kernel(input_, self.weight), self.tp_group), None


class ParallelSite(nn.Module):
    """A decoder linear site backed by a megatron-core parallel linear (``self.linear``).

    ``kind``: ``"column"`` (output split over TP) or ``"row"`` (input split over TP);
    ``parts``: the PEFT modules of the fused output with their *full* row counts (column).
    """

    def __init__(self, linear: nn.Module, *, kind: str, parts: tuple[tuple[str, int], ...]) -> None:
        super().__init__()
        self.linear = linear
        self.kind = kind
        self.parts = parts

    @property
    def weight(self) -> Tensor:
        """The local shard (found through a LoRA wrapper's ``base``)."""
        inner = getattr(self.linear, "base", self.linear)
        weight = inner.weight
        assert isinstance(weight, Tensor)
        return weight

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        y: Tensor = out[0] if isinstance(out, tuple) else out
        return y

    def extra_repr(self) -> str:
        return f"{self.kind}: " + ", ".join(f"{n}[{rows}]" for n, rows in self.parts)
