"""The GRPO objective of one (micro-)batch: the loss terms of ``losses`` composed per config.

loss = agg(w · L_ppo) + β · agg(KL) − c_H · agg(H), with w the TIS/icepop weights (only when
``tis`` is on), KL only when ``use_kl_loss`` is on, and every agg the configured
aggregation over the same packed sequences. Metrics come with it: the PPO terms (``ppo_kl``,
``pg_clipfrac``), and, whenever the rollout's log probabilities are given, the train/rollout
mismatch. Passing ``rollout_logp`` with TIS off changes metrics only, never the loss (the
miles quirk this avoids is described in ``losses``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from posttrain.grpo._errors import GrpoInputError
from posttrain.grpo._tensors import as_bool_mask, check_same_shape, float_tensor
from posttrain.grpo.config import GrpoConfig, KlType, LossAggregation, TisMode
from posttrain.grpo.losses import (
    aggregate_loss,
    importance_weights,
    kl_penalty,
    mismatch_metrics,
    ppo_clip_loss,
)

# LossSettings field -> GrpoConfig field, where the names differ.
_CONFIG_NAMES = {"aggregation": "loss_aggregation"}
_DEFAULTS = GrpoConfig()  # LossSettings' defaults are the config's


@dataclass(frozen=True, slots=True, kw_only=True)
class LossSettings:
    """The loss options of a ``GrpoConfig`` (validated there), with its defaults.

    Each field is the config field of the same name, except ``aggregation``
    (``loss_aggregation``); ``from_config`` copies them.
    """

    clip_low: float = _DEFAULTS.clip_low
    clip_high: float | None = _DEFAULTS.clip_high
    dual_clip: float | None = _DEFAULTS.dual_clip
    use_kl_loss: bool = _DEFAULTS.use_kl_loss
    kl_coef: float = _DEFAULTS.kl_coef
    kl_type: KlType = _DEFAULTS.kl_type
    entropy_coef: float = _DEFAULTS.entropy_coef
    tis: TisMode = _DEFAULTS.tis
    tis_clip_low: float = _DEFAULTS.tis_clip_low
    tis_clip_high: float = _DEFAULTS.tis_clip_high
    aggregation: LossAggregation = _DEFAULTS.loss_aggregation

    @classmethod
    def from_config(cls, cfg: GrpoConfig) -> LossSettings:
        return cls(**{f.name: getattr(cfg, _CONFIG_NAMES.get(f.name, f.name)) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class PolicyObjective:
    """``loss``: the scalar to backpropagate; ``metrics``: plain floats for the step log."""

    loss: Tensor
    metrics: dict[str, float]


def policy_objective(
    *,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    lengths: Sequence[int] | Tensor,
    settings: LossSettings,
    rollout_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    global_batch_size: int | None = None,
    global_token_count: int | None = None,
    token_weights: Tensor | None = None,
) -> PolicyObjective:
    """The GRPO loss of packed sequences ``[T]`` and its metrics.

    ``logp``: the current policy (carries the graph); ``old_logp``: the policy that sampled,
    as the trainer recomputes it; ``rollout_logp``: what the engine reported (needed for TIS,
    optional otherwise); ``ref_logp``: the reference (needed with ``use_kl_loss``);
    ``entropy``: per-token entropy (``entropy_from_logits``; needed when ``entropy_coef`` != 0).
    ``token_weights``: this batch's rows of ``aggregation_weights`` computed over whole
    sequences; when given, every aggregate is ``Σ mask·w·x`` and ``lengths`` is not used (a
    context-parallel rank holds only part of each sequence; the ranks' losses add up).
    """
    s = settings
    weights = None
    if token_weights is not None:
        weights = float_tensor(token_weights, "token_weights").detach()
        check_same_shape(("logp", logp), ("token_weights", weights))

    def agg(x: Tensor) -> Tensor:
        if weights is not None:
            m = as_bool_mask(mask, x.shape, "mask")
            return torch.where(m, x * weights, torch.zeros_like(x)).sum()
        return aggregate_loss(
            x,
            mask,
            lengths,
            mode=s.aggregation,
            global_batch_size=global_batch_size,
            global_token_count=global_token_count,
        )

    pl = ppo_clip_loss(
        logp, old_logp, advantages, mask,
        clip_low=s.clip_low, clip_high=s.clip_high, dual_clip=s.dual_clip,
    )  # fmt: skip
    m = as_bool_mask(mask, pl.loss.shape, "mask")
    count = max(int(m.sum()), 1)
    metrics: dict[str, float] = {
        "ppo_kl": float(agg(pl.approx_kl)),
        "pg_clipfrac": float(pl.clipped.sum()) / count,
        "dual_clipfrac": float(pl.dual_clipped.sum()) / count,
    }
    per_token = pl.loss
    if s.tis != "off":
        if rollout_logp is None:
            raise GrpoInputError(f"tis={s.tis} needs rollout_logp (the engine's log probs)")
        w = importance_weights(
            old_logp, rollout_logp,
            mode=s.tis, clip_low=s.tis_clip_low, clip_high=s.tis_clip_high, mask=m,
        )  # fmt: skip
        per_token = per_token * w
        metrics["tis_weight_mean"] = float(w.sum()) / count
        off = m & ((w == s.tis_clip_low) | (w == s.tis_clip_high) | (w == 0))
        metrics["tis_clipfrac"] = float(off.sum()) / count
    if rollout_logp is not None:
        metrics.update(mismatch_metrics(old_logp, rollout_logp, m))
    pg_loss = agg(per_token)
    loss = pg_loss
    metrics["pg_loss"] = float(pg_loss.detach())
    if s.use_kl_loss:
        if ref_logp is None:
            raise GrpoInputError("use_kl_loss needs ref_logp (the reference policy's log probs)")
        kl = agg(kl_penalty(logp, ref_logp, s.kl_type))
        loss = loss + s.kl_coef * kl
        metrics["kl_loss"] = float(kl.detach())
    if entropy is not None:
        ent = agg(entropy)
        metrics["entropy"] = float(ent.detach())
        if s.entropy_coef != 0.0:
            loss = loss - s.entropy_coef * ent
    elif s.entropy_coef != 0.0:
        raise GrpoInputError(f"entropy_coef={s.entropy_coef} needs the per-token entropy")
    metrics["loss"] = float(loss.detach())
    return PolicyObjective(loss=loss, metrics=metrics)
