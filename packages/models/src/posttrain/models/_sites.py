"""Linear sites: every 2-D linear of the decoder as a module that computes with the model's kernel.

The decoder keeps its weights fused (``qkv``, ``fc1 = [gate; up]``) as parameters of the layer,
not as one ``nn.Linear`` per HF module. A ``LinearSite`` is the module view of one such
weight: ``forward(x) = linear_kernel(x, weight)``, with ``linear_kernel`` the model's current
kernel (``StrictOps.linear`` in strict numerics) and ``weight`` read from the owning layer at
call time. The site owns no parameter, so names, checkpoints, conversion and FSDP sharding see
exactly the parameters they saw before. A site may add a bias parameter of its owner
(Qwen2's ``q/k/v_proj.bias``, fused as ``qkv_bias``) after the kernel, as ``nn.Linear`` does.

Why: a wrapper that adds to a linear's output (``lora-core``'s ``LoraLinear``) can replace a
site and reach the model's own kernel through ``linear_kernel``, so a trainer's LoRA forward
runs the same kernels in the same order as the engine's per-request adapters (``_lora``).
``parts`` names the PEFT modules a fused site is made of (``q_proj``, ``k_proj``, ``v_proj``
rows of ``qkv``), in storage order. Stacked experts are 3-D and are not sites.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from posttrain.formats import LinearKernel
    from posttrain.models._model import DecoderModel


class LinearSite(nn.Module):
    """``y = linear_kernel(x, weight) (+ bias)`` for one fused weight of the decoder (see the module doc)."""

    in_features: int
    out_features: int
    _model: DecoderModel
    _owner: nn.Module

    def __init__(
        self,
        model: DecoderModel,
        owner: nn.Module,
        param: str,
        *,
        parts: tuple[tuple[str, int], ...],
        bias: str | None = None,
    ) -> None:
        super().__init__()
        # Plain references, not submodules: the model and the owning layer hold this site.
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_owner", owner)
        self.param = param
        self.parts = parts
        self.bias_param = bias
        weight = self.weight
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])

    @property
    def weight(self) -> Tensor:
        """The owning layer's parameter (whatever FSDP or a weight load has put there)."""
        value: Tensor = getattr(self._owner, self.param)
        return value

    @property
    def linear_kernel(self) -> LinearKernel:
        """The model's ``linear(x, w) = x @ w.T`` in its current numerics."""
        return self._model.ops.linear

    @property
    def bias(self) -> Tensor | None:
        """The owning layer's bias parameter (``bias=`` at construction), or None."""
        if self.bias_param is None:
            return None
        value: Tensor = getattr(self._owner, self.bias_param)
        return value

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear_kernel(x, self.weight)
        bias = self.bias
        return y if bias is None else y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        names = ", ".join(f"{n}[{rows}]" for n, rows in self.parts)
        return f"{self.param}: in={self.in_features}, out={self.out_features}; {names}"
