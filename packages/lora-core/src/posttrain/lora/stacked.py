"""LoRA on stacked expert parameters (transformers 5 MoE), as a parametrization.

Transformers 5 keeps a Qwen3-MoE layer's experts as two 3-D parameters of one module
(``...mlp.experts``): ``gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows;
the forward splits ``x @ W_e.T`` in halves) and ``down_proj [E, H, I]``. There is no
``nn.Linear`` per expert to wrap, so ``attach_lora`` registers a ``LoraStackedExperts`` as a
``torch.nn.utils.parametrize`` parametrization of the parameter: every read of
``experts.gate_up_proj`` in the model's own forward returns

    W + scaling * [B_gate,e @ A_gate,e ; B_up,e @ A_up,e]   (per expert e, fp32 delta)

so the model's expert kernels run unchanged. The factors are per expert and per part, exactly
the per-expert PEFT adapter (``...experts.<e>.gate_proj`` etc., what SGLang and transformers 4
read): ``lora_A [E, P, r, in]``, ``lora_B [E, P, out_part, r]`` with ``P`` parts (gate and up,
or down). ``posttrain.formats`` converts to PEFT's ``target_parameters`` form on export.
Replicated (no expert parallelism): the whole stack lives on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.lora.config import LoraConfig

STACKED_PARTS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""Stacked expert parameter name -> the per-expert PEFT module names it is made of, in row order."""


class LoraStackedExperts(nn.Module):
    """A parametrization adding per-expert, per-part LoRA deltas to a stacked ``[E, out, in]``."""

    def __init__(
        self,
        *,
        path: str,
        container: str,
        parts: tuple[str, ...],
        config: LoraConfig,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
    ) -> None:
        super().__init__()
        self.path, self.container, self.parts = path, container, parts
        self.scaling = config.scaling
        self.merged = False
        self.enabled = True
        self.lora_A = nn.Parameter(lora_a.to(config.param_dtype).contiguous())
        self.lora_B = nn.Parameter(lora_b.to(config.param_dtype).contiguous())

    @property
    def num_experts(self) -> int:
        return int(self.lora_A.shape[0])

    def hf_name(self, expert: int, part: int) -> str:
        """The PEFT module path of ``expert``'s ``part`` (``<container>.<e>.gate_proj``)."""
        return f"{self.container}.{expert}.{self.parts[part]}"

    def delta(self) -> torch.Tensor:
        """``scaling * B @ A`` per expert and part, parts stacked on the output rows: ``[E, out, in]``."""
        e, p, out_part, _ = self.lora_B.shape
        d = torch.einsum("epor,epri->epoi", self.lora_B, self.lora_A) * self.scaling
        return d.reshape(e, p * out_part, d.shape[-1])

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.merged or not self.enabled:
            return weight
        return weight + self.delta().to(weight.dtype)

    def merge(self) -> None:
        """Fold the delta into the stored (original) parameter, in fp32; no unmerge."""
        if self.merged:
            return
        original = self._original
        with torch.no_grad():
            original.copy_((original.float() + self.delta().float()).to(original.dtype))
        self.merged = True

    def bind_original(self, original: torch.Tensor) -> None:
        """Remember the stored parameter (``parametrizations.<name>.original``) for ``merge``.

        A plain reference, not a registered parameter: it stays the owner's.
        """
        object.__setattr__(self, "_original", original)

    _original: torch.Tensor
