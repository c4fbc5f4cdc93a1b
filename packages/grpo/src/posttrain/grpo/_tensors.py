"""Input checks shared by the GRPO math: masks, packed lengths, matching shapes.

Every check names the tensor at fault and its shape; none copies data it does not need to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from posttrain.grpo._errors import GrpoInputError


def as_int_vector(values: Sequence[int] | Tensor, name: str) -> Tensor:
    """A 1-D int64 tensor from a list of ints or an integer tensor (bools refused)."""
    if isinstance(values, Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise GrpoInputError(f"{name} must be integers, got dtype {values.dtype}")
        if values.dim() != 1:
            raise GrpoInputError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        return values.detach().to(torch.int64)
    items = list(values)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise GrpoInputError(f"{name} must be integers")
    return torch.tensor(items, dtype=torch.int64)


def as_lengths(lengths: Sequence[int] | Tensor) -> Tensor:
    """Packed sequence lengths: 1-D, integers, none negative (zero is allowed)."""
    lens = as_int_vector(lengths, "lengths")
    if lens.numel() and int(lens.min()) < 0:
        raise GrpoInputError(f"lengths holds a negative length {int(lens.min())}")
    return lens


def as_bool_mask(mask: Tensor, shape: torch.Size, name: str) -> Tensor:
    """A loss mask as bool; accepts bool or 0/1 numbers, refuses anything else."""
    if not isinstance(mask, Tensor) or mask.shape != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise GrpoInputError(f"{name} has shape {got}; expected {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask.detach()
    m = mask.detach()
    if not bool(((m == 0) | (m == 1)).all()):
        raise GrpoInputError(f"{name} must hold only 0 and 1 (or be bool)")
    return m != 0


def float_tensor(x: Tensor, name: str) -> Tensor:
    """``x`` as float32 (graph kept); refuses non-tensors and non-floating dtypes."""
    if not isinstance(x, Tensor):
        raise GrpoInputError(f"{name} must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise GrpoInputError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    return x.to(torch.float32)


def check_same_shape(reference: tuple[str, Tensor], *others: tuple[str, Tensor]) -> None:
    """Every tensor in ``others`` has the shape of ``reference``; the error names both."""
    ref_name, ref = reference
    for name, t in others:
        if t.shape != ref.shape:
            raise GrpoInputError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}"
            )
