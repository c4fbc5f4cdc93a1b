"""Advantages: group-normalised rewards (GRPO), token broadcast, optional whitening.

GRPO scores each sample against the other samples of its prompt: r̃ = r − mean_g, then,
with std normalisation on, r̃ / (σ_g + ε) with σ_g the *unbiased* group std. Where this
departs from the textbook (and matches miles, design note opd-scoring.md §6):

- ε is added only where it can matter: a group of one sample, or one whose rewards are all
  equal (σ_g = 0), is never divided, so its advantages are exactly 0 rather than 0/ε noise.
  Exactly: a zero-variance group is set to 0, not computed as r − mean, which float rounding
  can leave a few ulps off zero (0.1 three times averages to 0.10000000149).
- TRL divides by σ + 1e-4 always; Dr. GRPO drops σ altogether (``std_normalize=False``).

Statistics are computed in float64 and the result is float32, detached: advantages carry no
graph. Group ids are any integers (not necessarily contiguous or sorted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from posttrain.grpo._errors import GrpoConfigError, GrpoInputError
from posttrain.grpo._tensors import as_bool_mask, as_int_vector, as_lengths


def group_normalized_advantages(
    rewards: Tensor,
    group_ids: Sequence[int] | Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample advantages ``[N]`` (float32, detached) from rewards ``[N]`` and group ids."""
    if not (eps >= 0.0 and eps < float("inf")):
        raise GrpoConfigError(f"eps={eps} must be finite and >= 0")
    r = _rewards(rewards)
    groups = _group_index(group_ids, r.shape[0]).to(r.device)
    if r.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=r.device)
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    size = counts.to(torch.float64)
    sums = torch.zeros_like(size).index_add(0, inverse, r)
    mean = sums / size
    centred = r - mean[inverse]
    gmax = torch.full_like(mean, -torch.inf).scatter_reduce(0, inverse, r, "amax")
    gmin = torch.full_like(mean, torch.inf).scatter_reduce(0, inverse, r, "amin")
    constant = (gmax == gmin)[inverse]  # groups of one and zero-variance groups
    if std_normalize:
        sq = torch.zeros_like(mean).index_add(0, inverse, centred * centred)
        std = torch.sqrt(sq / (size - 1).clamp(min=1.0))
        divide = (counts > 1) & (std > 0)
        denom = torch.where(divide, std + eps, torch.ones_like(std))
        centred = centred / denom[inverse]
    out = torch.where(constant, torch.zeros_like(centred), centred)
    return out.to(torch.float32)


def contiguous_group_ids(num_samples: int, group_size: int) -> Tensor:
    """Group ids for samples laid out prompt by prompt: ``[0]*n + [1]*n + ...``."""
    if group_size < 1 or num_samples < 0 or num_samples % group_size:
        raise GrpoConfigError(
            f"num_samples={num_samples} is not a whole number of groups of {group_size}"
        )
    return torch.arange(num_samples // group_size).repeat_interleave(group_size)


def expand_to_tokens(values: Tensor, lengths: Sequence[int] | Tensor) -> Tensor:
    """Repeat each per-sequence value over its tokens: ``[N]`` -> ``[sum(lengths)]``.

    GRPO gives every token of a response its sample's advantage (design note §6).
    """
    lens = as_lengths(lengths)
    if values.dim() != 1 or values.shape[0] != lens.shape[0]:
        raise GrpoInputError(
            f"values has shape {tuple(values.shape)}; expected [{lens.shape[0]}] (one per length)"
        )
    return values.detach().repeat_interleave(lens.to(values.device))


def whiten_advantages(advantages: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """(A − mean) / sqrt(var + eps) over the masked tokens; masked-out tokens become 0.

    The optional whitening pass after group normalisation (and after OPD shaping). Mean and
    (biased) variance are over this batch's masked tokens; detached, float32.
    """
    if not (eps > 0.0 and eps < float("inf")):
        raise GrpoConfigError(f"eps={eps} must be finite and > 0")
    a = advantages.detach().to(torch.float64)
    m = as_bool_mask(mask, a.shape, "mask")
    count = m.sum().clamp(min=1).to(torch.float64)
    a0 = torch.where(m, a, torch.zeros_like(a))
    mean = a0.sum() / count
    var = torch.where(m, (a - mean) ** 2, torch.zeros_like(a)).sum() / count
    out = torch.where(m, (a - mean) / torch.sqrt(var + eps), torch.zeros_like(a))
    return out.to(torch.float32)


def _rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise GrpoInputError(f"rewards must be a 1-D tensor [N], got {shape}")
    r = rewards.detach().to(torch.float64)
    bad = (~torch.isfinite(r)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise GrpoInputError(f"rewards[{i}]={float(r[i])} is not finite")
    return r


def _group_index(group_ids: Sequence[int] | Tensor, n: int) -> Tensor:
    g = as_int_vector(group_ids, "group_ids")
    if g.shape[0] != n:
        raise GrpoInputError(f"group_ids has {g.shape[0]} entries but rewards has {n}")
    return g
