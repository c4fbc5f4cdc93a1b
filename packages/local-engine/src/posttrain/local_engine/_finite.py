"""The one check that no weight the engine installs holds NaN or Inf.

A non-finite weight does not fail loudly: the engine would answer 200, greedy decoding would
emit token 0 forever, ``/health_generate`` would pass, and only a logprob request would break.
So every path that installs weights (checkpoint at start, ``/update_weights_from_disk``, each
wsync/1 bucket, every LoRA adapter) calls ``check_finite`` before anything is swapped, and the
update is refused with ``NonFiniteWeightsError`` naming the tensor.

Integer and bool tensors (NVFP4 codes, indices) cannot hold NaN and are skipped. float8 types
have no ``isfinite`` kernel on CPU, so they are widened to fp32 first (exact).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from posttrain.local_engine._errors import NonFiniteWeightsError

__all__ = ["check_finite"]

_WIDEN = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def _non_finite_count(t: torch.Tensor) -> int:
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    x = t.float() if t.dtype in _WIDEN else t
    ok = torch.isfinite(x)
    return 0 if bool(ok.all()) else int(ok.numel() - int(ok.sum()))


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], *, what: str) -> None:
    """Raise ``NonFiniteWeightsError`` naming the first tensor of ``what`` that holds NaN/Inf."""
    for name, t in tensors:
        bad = _non_finite_count(t)
        if bad:
            raise NonFiniteWeightsError(
                f"{what}: tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf) of "
                f"{t.numel()}; refused, nothing was changed"
            )
