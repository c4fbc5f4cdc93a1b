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

Finite is not enough: a weight of 3e38 is finite, yet the first matmul overflows and every
logprob after it is garbage. ``check_finite`` therefore also refuses any value whose magnitude
exceeds a bound, from the same ``aminmax`` pass: ``max_abs`` when the caller gives one, else
``max_abs_weight()`` (``$POSTTRAIN_MAX_ABS_WEIGHT``, default 1e4, far above any trained
weight, far below what overflows bf16/fp32 compute).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

import torch

__all__ = [
    "DEFAULT_MAX_ABS_WEIGHT",
    "MAX_ABS_WEIGHT_ENV",
    "check_finite",
    "count_non_finite",
    "max_abs_weight",
    "value_range",
]

DEFAULT_MAX_ABS_WEIGHT = 1e4
MAX_ABS_WEIGHT_ENV = "POSTTRAIN_MAX_ABS_WEIGHT"


def max_abs_weight() -> float:
    """The magnitude bound for weights: ``$POSTTRAIN_MAX_ABS_WEIGHT`` or 1e4.

    A value that is not a positive number is a ``ValueError`` naming the variable.
    """
    raw = os.environ.get(MAX_ABS_WEIGHT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MAX_ABS_WEIGHT
    try:
        bound = float(raw)
    except ValueError:
        bound = math.nan
    if not bound > 0:
        raise ValueError(f"${MAX_ABS_WEIGHT_ENV}={raw!r}: must be a positive number (or inf)")
    return bound


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
    max_abs: float | None = None,
) -> None:
    """Raise ``error(message)`` naming the first tensor of ``what`` that holds NaN or Inf, or a
    value of magnitude above ``max_abs`` (default ``max_abs_weight()``; ``math.inf``: none).

    ``error`` is the caller's class (an engine's ``NonFiniteWeightsError``): the caller knows
    which of its errors a refused tensor is.
    """
    bound = max_abs_weight() if max_abs is None else max_abs
    for name, t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        low, high = value_range(t)
        if not (math.isfinite(low) and math.isfinite(high)):
            bad = count_non_finite(t)
            raise error(
                f"{what}: tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf) of "
                f"{t.numel()}; refused, nothing was changed"
            )
        peak = max(abs(low), abs(high))
        if peak > bound:
            raise error(
                f"{what}: tensor {name!r} holds a value of magnitude {peak:.3g}, above the "
                f"bound {bound:.3g} (${MAX_ABS_WEIGHT_ENV}); refused, nothing was changed"
            )
