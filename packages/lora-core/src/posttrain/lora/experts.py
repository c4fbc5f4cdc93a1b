"""MoE experts with LoRA, sharded over expert parallelism (EP); expert TP must be 1.

``ExpertLinear`` holds the local experts' weights ``[E_loc, out, in]`` and applies expert ``e``
to its contiguous slice of the (already dispatched, expert-sorted) tokens. Two LoRA layouts,
not checkpoint-compatible with each other:

* per-expert (``shared=None``): every expert owns ``A [r, in]`` and ``B [out, r]``; both are
  EP-sharded on the expert dim and reduced over the expert-data-parallel group. Exported as
  one PEFT module per expert (``Target.hf_name`` with an ``{expert}`` field, global index).
* shared-outer (SGLang ``expert_dim=1``): the outer factor is shared by all experts
  (``shared="A"`` on gate/up: ``A [r, in]``; ``shared="B"`` on down: ``B [out, r]``), the inner
  one is per expert. The shared factor is replicated over EP while tokens are split over EP, so
  its grad is SUMmed over EP (tag ``ep_partial``). Exported stacked: the shared factor as
  ``[1, ...]``, the per-expert one as ``[E, ...]``.

Op order matches ``LoraLinear``: ``h = x @ A.T`` (shared A: one matmul for all tokens), then
``((h_e @ B_e.T) * scaling)`` per expert, added to the base output.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup

from posttrain.lora._errors import LayoutError
from posttrain.lora.comm import group_size
from posttrain.lora.config import LoraConfig


class ExpertLinear(nn.Module):
    """``E_loc`` bias-free linears applied to consecutive token slices (``tokens_per_expert``)."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        ep_group: ProcessGroup | None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        ep = group_size(ep_group)
        if num_experts % ep:
            raise LayoutError(f"ExpertLinear: {num_experts} experts not divisible by EP {ep}")
        self.num_experts, self.in_features, self.out_features = (
            num_experts,
            in_features,
            out_features,
        )
        self.ep_group = ep_group
        self.weight = nn.Parameter(
            torch.zeros(num_experts // ep, out_features, in_features, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        xs = torch.split(x, tokens_per_expert)
        return torch.cat([xe @ self.weight[e].T for e, xe in enumerate(xs)])


class LoraExpertLinear(nn.Module):
    """An ``ExpertLinear`` with per-expert or shared-outer LoRA factors."""

    def __init__(
        self,
        base: ExpertLinear,
        *,
        path: str,
        hf_name: str,
        shared: Literal["A", "B"] | None,
        config: LoraConfig,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
    ) -> None:
        super().__init__()
        self.base = base
        self.path, self.hf_name, self.shared = path, hf_name, shared
        self.scaling = config.scaling
        self.merged = False
        self.enabled = True
        self.lora_A = nn.Parameter(lora_a.to(config.param_dtype).contiguous())
        self.lora_B = nn.Parameter(lora_b.to(config.param_dtype).contiguous())

    def lora_delta(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """The LoRA output for expert-sorted tokens (see the module docstring for op order)."""
        xa = x.to(self.lora_A.dtype)
        if self.shared == "A":
            hs = torch.split(xa @ self.lora_A.T, tokens_per_expert)
        else:
            hs = tuple(
                xe @ self.lora_A[e].T for e, xe in enumerate(torch.split(xa, tokens_per_expert))
            )
        if self.shared == "B":
            outs = [(h @ self.lora_B.T) * self.scaling for h in hs]
        else:
            outs = [(h @ self.lora_B[e].T) * self.scaling for e, h in enumerate(hs)]
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        y: torch.Tensor = self.base(x, tokens_per_expert)
        if self.merged or not self.enabled:
            return y
        return y + self.lora_delta(x, tokens_per_expert).to(y.dtype)

    def merge(self) -> None:
        """Fold each expert's ``scaling * B_e @ A_e`` into its weight (fp32, local)."""
        if self.merged:
            return
        a = self.lora_A.float()
        b = self.lora_B.float()
        n = self.base.weight.shape[0]
        a_e = a.expand(n, *a.shape) if self.shared == "A" else a
        b_e = b.expand(n, *b.shape) if self.shared == "B" else b
        with torch.no_grad():
            w = self.base.weight
            w.copy_((w.float() + torch.bmm(b_e, a_e) * self.scaling).to(w.dtype))
        self.merged = True
