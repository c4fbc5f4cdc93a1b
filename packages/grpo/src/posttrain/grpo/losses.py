"""Policy-loss terms, per token: PPO clip, KL estimators, entropy, TIS/icepop, aggregation.

Pure torch, float32, out of place. Every "old" quantity (old-policy, rollout, reference log
probabilities, advantages) is detached on entry, so gradient flows only through the current
policy's ``logp`` (and the logits, for entropy). The formulas are miles' (design note
opd-scoring.md §6); where they depart from the obvious:

- ``ppo_clip_loss`` sanitises the log ratio before ``exp``: NaN -> 0, ±inf -> ±20, then clamps
  to ±20, so one broken token cannot overflow the batch. Masked tokens have their ratio and
  advantage zeroed first, so a NaN/inf there never reaches the loss or the gradient.
- ``clipped`` marks tokens whose clipped term is strictly larger than the unclipped one (the
  clip fraction). Those tokens get zero gradient: the max picks the clamped ratio, which is
  constant outside the window.
- ``importance_weights`` is computed from the *old* (trainer-recomputed) log probabilities and
  the rollout engine's, never from the current policy: it corrects the train/serve mismatch,
  not the policy update, and is detached.
- ``mismatch_metrics`` is separate from the weights on purpose: miles' built-in weighting also
  ran when only the metrics flag was set, so asking for metrics changed the loss. Here metrics
  are a pure read (no grad, no in-place), and ``importance_weights`` runs only if the caller
  asks for TIS.
- ``aggregate_loss`` works on packed sequences (``per_token[T]`` concatenates sequences of
  ``lengths``); every denominator is clamped to >= 1, so an all-masked batch gives 0, not NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posttrain.grpo._errors import GrpoConfigError, GrpoInputError
from posttrain.grpo._tensors import as_bool_mask, as_lengths, check_same_shape, float_tensor
from posttrain.grpo.config import KlType, LossAggregation

WeightMode = Literal["tis", "icepop"]  # TisMode without "off": the weights exist

LOG_RATIO_LIMIT = 20.0  # |log ratio| above this is clamped before exp (e^20 ~ 4.9e8)
LOW_VAR_KL_LIMIT = 10.0  # low_var_kl and train_rollout_kl are clamped to [-10, 10]


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """Per-token PPO terms, all shaped like ``logp``; masked tokens hold 0 / False.

    ``loss`` carries the graph; the rest are detached. ``approx_kl`` is logπ_old − logπ
    (the ``ppo_kl`` metric's per-token value); ``dual_clipped`` marks negative-advantage
    tokens whose loss the dual clip bounded.
    """

    loss: Tensor
    clipped: Tensor
    ratio: Tensor
    approx_kl: Tensor
    dual_clipped: Tensor


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLoss:
    """L = max(−ρ·A, −clip(ρ, 1−ε_lo, 1+ε_hi)·A), ρ = exp(logπ − logπ_old), per token.

    With ``dual_clip`` c (> 1), tokens with A < 0 get L = min(L, −c·A).
    """
    eps_high = _check_clip(clip_low, clip_high, dual_clip)
    new = float_tensor(logp, "logp")
    old = float_tensor(old_logp, "old_logp").detach()
    adv = float_tensor(advantages, "advantages").detach()
    check_same_shape(("logp", new), ("old_logp", old), ("advantages", adv))
    m = as_bool_mask(mask, new.shape, "mask")
    zero = torch.zeros_like(new)
    delta = torch.where(m, old - new, zero)  # logπ_old − logπ
    adv = torch.where(m, adv, torch.zeros_like(adv))
    log_ratio = torch.nan_to_num(-delta, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -ratio * adv
    clipped_term = -ratio.clamp(1.0 - clip_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped_term)
    clipped = (clipped_term > unclipped) & m
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound) & m
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    loss = torch.where(m, loss, zero)
    return PolicyLoss(
        loss=loss,
        clipped=clipped,
        ratio=torch.where(m, ratio, zero).detach(),
        approx_kl=(-log_ratio).detach(),
        dual_clipped=dual,
    )


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KlType) -> Tensor:
    """Per-token KL(π || π_ref) estimate from samples of π, x = logπ − logπ_ref.

    k1 = x; k2 = x²/2; k3 = e^{−x} − 1 + x; low_var_kl = k3 with −x clamped to ±20 and the
    result clamped to [−10, 10]. Gradient flows through ``logp`` only.
    """
    new = float_tensor(logp, "logp")
    ref = float_tensor(ref_logp, "ref_logp").detach()
    check_same_shape(("logp", new), ("ref_logp", ref))
    x = new - ref
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return torch.exp(-x) - 1.0 + x
    if kind == "low_var_kl":
        neg = (-x).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return (torch.exp(neg) - 1.0 - neg).clamp(-LOW_VAR_KL_LIMIT, LOW_VAR_KL_LIMIT)
    raise GrpoConfigError(f"kl kind={kind!r} is not one of k1, k2, k3, low_var_kl")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = −Σ_v p_v log p_v over the full vocabulary, per row of ``logits[T, V]`` -> ``[T]``.

    Computed from ``log_softmax`` (stable for any logit scale); entries with p = 0 (e.g.
    −inf logits of a masked vocabulary) contribute exactly 0 and no NaN gradient.
    """
    x = float_tensor(logits, "logits")
    if x.dim() != 2:
        raise GrpoInputError(f"logits must be [T, V], got shape {tuple(x.shape)}")
    logp = torch.log_softmax(x, dim=-1)
    finite = torch.isfinite(logp)
    safe = torch.where(finite, logp, torch.zeros_like(logp))
    p = torch.where(finite, safe.exp(), torch.zeros_like(logp))
    return -(p * safe).sum(dim=-1)


def importance_weights(
    train_logp: Tensor,
    rollout_logp: Tensor,
    *,
    mode: WeightMode,
    clip_low: float = 0.0,
    clip_high: float = 2.0,
    mask: Tensor | None = None,
) -> Tensor:
    """Detached per-token weights w from ρ = exp(logπ_train − logπ_rollout).

    ``tis``: w = clamp(ρ, clip_low, clip_high) (truncated importance sampling).
    ``icepop``: w = ρ inside [clip_low, clip_high], 0 outside. A NaN log ratio gives 0 in both
    modes; tokens outside ``mask`` get 0. ``train_logp`` is the trainer's old-policy recompute.
    """
    if not (0.0 <= clip_low < clip_high < float("inf")):
        raise GrpoConfigError(
            f"clip_low={clip_low}, clip_high={clip_high}: need 0 <= clip_low < clip_high < inf"
        )
    train = float_tensor(train_logp, "train_logp").detach()
    roll = float_tensor(rollout_logp, "rollout_logp").detach()
    check_same_shape(("train_logp", train), ("rollout_logp", roll))
    log_ratio = train - roll
    ratio = torch.exp(log_ratio)  # inf where the ratio overflows: clamped/zeroed below
    if mode == "tis":
        w = ratio.clamp(clip_low, clip_high)
    elif mode == "icepop":
        inside = (ratio >= clip_low) & (ratio <= clip_high)
        w = torch.where(inside, ratio, torch.zeros_like(ratio))
    else:
        raise GrpoConfigError(f"importance weight mode={mode!r} is not one of tis, icepop")
    w = torch.where(torch.isnan(log_ratio), torch.zeros_like(w), w)
    if mask is not None:
        m = as_bool_mask(mask, train.shape, "mask")
        w = torch.where(m, w, torch.zeros_like(w))
    return w


def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the trainer's log probabilities are from the engine's, over masked tokens.

    ``train_rollout_logprob_abs_diff``: mean |Δ|; ``train_rollout_logprob_max_abs_diff``:
    max |Δ|; ``train_rollout_logprob_equal_frac``: fraction with Δ exactly 0 (strict parity
    wants 1.0); ``train_rollout_kl``: mean k3 estimate of KL(π_rollout || π_train) from the
    rollout's samples, clamped to ±10 per token. A read-only function: it never changes a loss.
    """
    with torch.no_grad():
        train = float_tensor(train_logp, "train_logp").detach()
        roll = float_tensor(rollout_logp, "rollout_logp").detach()
        check_same_shape(("train_logp", train), ("rollout_logp", roll))
        m = as_bool_mask(mask, train.shape, "mask")
        zero = torch.zeros_like(train)
        delta = torch.where(m, train - roll, zero)
        absd = delta.abs()
        x = (-delta).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # logπ_rollout − logπ_train
        k3 = (torch.exp(-x) - 1.0 + x).clamp(-LOW_VAR_KL_LIMIT, LOW_VAR_KL_LIMIT)
        stats = [
            m.sum(),
            absd.sum(),
            absd.max() if absd.numel() else absd.new_zeros(()),
            ((train == roll) & m).sum(),
            torch.where(m, k3, zero).sum(),
        ]
        # one host transfer for all of them (each float() of a device tensor is a sync)
        masked, abs_sum, abs_max, equal, kl = torch.stack([v.double() for v in stats]).tolist()
        count = max(int(masked), 1)
        return {
            "train_rollout_logprob_abs_diff": abs_sum / count,
            "train_rollout_logprob_max_abs_diff": abs_max,
            "train_rollout_logprob_equal_frac": equal / count if masked else 1.0,
            "train_rollout_kl": kl / count,
        }


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    lengths: Sequence[int] | Tensor,
    *,
    mode: LossAggregation,
    global_batch_size: int | None = None,
    global_token_count: int | None = None,
) -> Tensor:
    """Reduce a packed per-token loss ``[T]`` (sequences of ``lengths``) to a scalar.

    ``token_mean``: Σ masked / max(1, Σ mask) (``global_token_count`` replaces Σ mask, for
    micro-batches whose sums are added). ``seq_mean_token_mean``: Σ over sequences of each
    sequence's masked mean, ÷ max(1, ``global_batch_size`` or the number of sequences).
    """
    x = float_tensor(per_token, "per_token")
    if x.dim() != 1:
        raise GrpoInputError(f"per_token must be 1-D [T], got shape {tuple(x.shape)}")
    m = as_bool_mask(mask, x.shape, "mask")
    lens = as_lengths(lengths)
    if int(lens.sum()) != x.shape[0]:
        raise GrpoInputError(
            f"lengths sum to {int(lens.sum())} but per_token has {x.shape[0]} tokens"
        )
    masked = torch.where(m, x, torch.zeros_like(x))
    if mode == "token_mean":
        denom = int(m.sum()) if global_token_count is None else global_token_count
        _check_count("global_token_count", global_token_count)
        return masked.sum() / max(1, denom)
    if mode != "seq_mean_token_mean":
        raise GrpoConfigError(f"aggregation mode={mode!r} is not token_mean or seq_mean_token_mean")
    _check_count("global_batch_size", global_batch_size)
    n_seq = lens.shape[0]
    lens = lens.to(x.device)
    seq = torch.arange(n_seq, device=x.device).repeat_interleave(lens)
    sums = torch.zeros(n_seq, dtype=x.dtype, device=x.device).index_add(0, seq, masked)
    counts = torch.zeros(n_seq, dtype=torch.int64, device=x.device)
    counts = counts.index_add(0, seq, m.to(torch.int64))
    per_seq = sums / counts.clamp(min=1).to(x.dtype)
    denom = n_seq if global_batch_size is None else global_batch_size
    return per_seq.sum() / max(1, denom)


def aggregation_weights(
    mask: Tensor,
    lengths: Sequence[int] | Tensor,
    *,
    mode: LossAggregation,
    global_batch_size: int | None = None,
    global_token_count: int | None = None,
) -> Tensor:
    """Per-token weights ``w[T]`` with ``Σ_t w_t·x_t == aggregate_loss(x, mask, lengths, ...)``.

    The aggregation as a linear map, so it can be applied to any subset of the tokens and the
    parts summed: under context parallel each rank holds some tokens of every sequence and
    sums ``w·x`` over its own (``policy_objective(token_weights=...)``). ``token_mean``:
    ``mask / max(1, global_token_count or Σ mask)``; ``seq_mean_token_mean``: ``mask`` over
    (the sequence's masked count, at least 1) x ``max(1, global_batch_size or #sequences)``.
    """
    lens = as_lengths(lengths)
    m = as_bool_mask(mask, torch.Size([int(lens.sum())]), "mask")
    weights = m.to(torch.float32)
    if mode == "token_mean":
        _check_count("global_token_count", global_token_count)
        denom = int(m.sum()) if global_token_count is None else global_token_count
        return weights / max(1, denom)
    if mode != "seq_mean_token_mean":
        raise GrpoConfigError(f"aggregation mode={mode!r} is not token_mean or seq_mean_token_mean")
    _check_count("global_batch_size", global_batch_size)
    n_seq = lens.shape[0]
    lens = lens.to(m.device)
    seq = torch.arange(n_seq, device=m.device).repeat_interleave(lens)
    counts = torch.zeros(n_seq, dtype=torch.int64, device=m.device)
    counts = counts.index_add(0, seq, m.to(torch.int64))
    denom = n_seq if global_batch_size is None else global_batch_size
    per_seq = 1.0 / (counts.clamp(min=1).to(torch.float32) * max(1, denom))
    return weights * per_seq[seq]


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise GrpoConfigError(f"{name}={value!r} must be an int >= 1")


def _check_clip(clip_low: float, clip_high: float | None, dual_clip: float | None) -> float:
    """Validate the clip settings; returns ε_hi (``clip_low`` when ``clip_high`` is None)."""
    if not 0.0 <= clip_low < 1.0:
        raise GrpoConfigError(f"clip_low={clip_low} must be in [0, 1)")
    eps_high = clip_low if clip_high is None else clip_high
    if not 0.0 <= eps_high < float("inf"):
        raise GrpoConfigError(f"clip_high={clip_high} must be finite and >= 0")
    if dual_clip is not None and not 1.0 < dual_clip < float("inf"):
        raise GrpoConfigError(f"dual_clip={dual_clip} must be finite and > 1")
    return eps_high
