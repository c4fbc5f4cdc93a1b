"""The LoRA forward, defined once: what a trainer and an engine must both compute.

A LoRA adapter adds ``scaling * B (A x)`` to a linear layer's output. Trainer and engine
return bit-identical logprobs only if they compute that delta with the same ops, in the
same order, with the same kernels. Two packages compute it: ``lora-core`` in the trainer's
``LoraLinear`` and ``models`` in the per-request adapter hook the engines run. Neither may
import the other, so the op lives here, below both, and each passes in its kernel:

    h     = linear(x, A)        # [tokens, r]
    h     = reduce(h)           # the layout's rank-r collective (identity on one process)
    delta = linear(h, B) * scaling

The caller adds ``delta`` to the base output (``y + delta``). ``linear(x, w)`` is
``x @ w.T``: ``matmul_kernel`` by default (in the weight's dtype, as ``nn.Linear``), or a
model's own kernel (``posttrain.models``' strict fp32 linear, whose rows and columns are
each reduced alone, so a fused B over q/k/v gives the same bits per column as three
separate Bs). Departure from PEFT (``lora_B(lora_A(dropout(x))) * scaling``): the same
arithmetic, but the kernel is the caller's, not ``F.linear``, and dropout stays with the
caller (it breaks train/rollout parity and is off by default).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LinearKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``linear(x, w) -> x @ w.T`` for ``x[..., in]`` and ``w[out, in]``."""


def matmul_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` computed in the weight's dtype (``x`` is cast first, as PEFT does)."""
    return x.to(weight.dtype) @ weight.T


def lora_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    *,
    linear: LinearKernel = matmul_kernel,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``linear(reduce(linear(x, A)), B) * scaling`` for ``A[r, in]``, ``B[out, r]``."""
    h = linear(x, lora_a)
    if reduce is not None:
        h = reduce(h)
    return linear(h, lora_b) * scaling
