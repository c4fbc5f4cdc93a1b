"""fp32 master weights for parameters kept in a low-precision dtype (bf16 / fp16).

Full-parameter training of a bf16 checkpoint must not step the bf16 parameters in place: an
AdamW update below bf16's resolution at a weight's scale rounds away and the weight never
moves. The fsdp backend gets masters from FSDP2 itself (the parameters are upcast to fp32
before sharding; the compute copy is cast to the checkpoint's dtype; see ``trainer``). The
megatron backend has no such wrapper, so ``MasterAdamW`` does it explicitly:

* it keeps an fp32 copy of every trainable parameter and runs AdamW on the copies;
* ``step()`` takes the parameters' gradients (in fp32), steps the masters and writes them back
  into the parameters, rounded to their dtype (the forward, the engine and the weight sync see
  the checkpoint's dtype, so strict parity holds);
* ``state_dict()`` holds the masters, so a checkpoint resumes them exactly;
  ``sync_from_parameters()`` re-takes them from the parameters after a weight load that came
  without them (trap 1 of issue 25: stale masters would silently undo the load).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MasterAdamW", "needs_masters"]

LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_masters(params: Iterable[Tensor]) -> bool:
    """Whether any of ``params`` is in a low-precision dtype."""
    return any(p.dtype in LOW_PRECISION for p in params)


class MasterAdamW(torch.optim.AdamW):
    """AdamW over fp32 masters of ``params`` (see the module doc)."""

    def __init__(self, params: Iterable[Tensor], **kwargs: Any) -> None:
        self.model_params = list(params)
        self.masters = [p.detach().float().clone() for p in self.model_params]
        super().__init__(self.masters, **kwargs)

    @torch.no_grad()
    def sync_from_parameters(self) -> None:
        """Take the masters from the parameters (after a load that did not restore them)."""
        for p, m in zip(self.model_params, self.masters, strict=True):
            m.copy_(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for p, m in zip(self.model_params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        loss: float | None = super().step(closure)
        for p, m in zip(self.model_params, self.masters, strict=True):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["masters"] = [m.detach().clone() for m in self.masters]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        masters = state.pop("masters", None)
        super().load_state_dict(state)
        if masters is None:
            self.sync_from_parameters()
            return
        with torch.no_grad():
            for p, m, saved in zip(self.model_params, self.masters, masters, strict=True):
                m.copy_(saved)
                p.copy_(m)
