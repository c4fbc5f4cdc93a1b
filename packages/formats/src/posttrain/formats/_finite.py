"""The finiteness check every reader of weights runs: one ``aminmax`` pass per tensor.

A weight that holds NaN or Inf does not fail loudly: an engine would answer 200, greedy decoding
would emit token 0 forever, and only a logprob request would break. So every format that carries
weights (PEFT adapters, NVFP4 scales) and every engine path that installs them refuses non-finite
values, through the functions here.

Departure from the obvious ``torch.isfinite(t).all()``: that builds a bool tensor as large as
``t`` and reduces it; one ``aminmax`` pass reads ``t`` once and allocates nothing (NaN propagates
into both extremes, +-Inf is one). On one CPU thread it reads a 64 MiB bf16 tensor in 0.4-0.9x
the time of copying it, where ``isfinite(t).all()`` took 38-40x
(``packages/local-engine/benchmarks/bench_finite_check.py``, docs/benchmarks/local-engine.md).
The bad values are counted only when there are some, for the message.

Integer and bool tensors (NVFP4 codes, indices) cannot hold NaN and are skipped; float8 types
are widened to fp32 first (exact), since ``aminmax`` has no float8 kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

__all__ = ["check_finite", "count_non_finite", "value_range"]

_WIDEN = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def _flat(t: torch.Tensor) -> torch.Tensor:
    return (t.float() if t.dtype in _WIDEN else t).reshape(-1)


def value_range(t: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of a non-empty floating tensor in one pass; NaN in both if ``t`` holds one."""
    low, high = torch.aminmax(_flat(t))
    return float(low), float(high)


def count_non_finite(t: torch.Tensor) -> int:
    """How many NaN or Inf values ``t`` holds (0 for integer, bool and empty tensors)."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    low, high = value_range(t)
    if math.isfinite(low) and math.isfinite(high):
        return 0
    x = _flat(t)
    return int(x.numel() - int(torch.isfinite(x).sum()))


def check_finite(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    what: str,
    error: Callable[[str], Exception],
) -> None:
    """Raise ``error(message)`` naming the first tensor of ``what`` that holds NaN or Inf.

    ``error`` is the caller's class (an engine's ``NonFiniteWeightsError``): the caller knows
    which of its errors a refused tensor is.
    """
    for name, t in tensors:
        bad = count_non_finite(t)
        if bad:
            raise error(
                f"{what}: tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf) of "
                f"{t.numel()}; refused, nothing was changed"
            )
