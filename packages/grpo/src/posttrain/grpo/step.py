"""One GRPO step on a rank's samples, the same code on every backend.

``compute_gradients`` splits the rank's samples into micro-batches, packs each
(``posttrain.grpo.batch``), runs the forward (context parallel when the policy's CP size is
above 1), the objective (``posttrain.grpo.objective``) and the backward, and reduces the
gradients; ``train_step`` adds clipping and the optimizer step. What differs between backends
comes in as ``StepRules``, built by the policy's backend (``TrainerBackend.step_rules``): how
gradients accumulate over micro-batches, the loss scale, how gradients are reduced, which
ranks report metrics, whether logprobs are computed chunk by chunk
(``posttrain.grpo.backend.StepRules``). What differs between full
and adapter training is the policy's mode (its reference model, its trainable parameters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.fsdp_mesh import scale_grads_to_norm
from posttrain.grpo._errors import GrpoInputError
from posttrain.grpo.backend import Policy, StepRules
from posttrain.grpo.batch import (
    CP_LAYOUT,
    PackedBatch,
    TrainSample,
    micro_batches,
    pack,
    pack_context_parallel,
)
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.losses import entropy_from_logits
from posttrain.grpo.objective import LossSettings, PolicyObjective, policy_objective
from posttrain.models import DecoderModel
from posttrain.models import context_parallel as cp

# Step metrics that are already normalised by the whole step (sum over ranks), and those
# that are maxima; every other metric is a per-token mean (weighted by each rank's tokens).
SUM_METRICS = frozenset({"loss", "pg_loss", "ppo_kl", "kl_loss", "entropy"})
MAX_METRICS = frozenset({"train_rollout_logprob_max_abs_diff"})


@dataclass(frozen=True, slots=True, kw_only=True)
class _StepContext:
    """What every micro-batch of one step shares."""

    cfg: GrpoConfig
    settings: LossSettings
    rules: StepRules
    global_batch_size: int
    global_token_count: int


def _response_logprobs(
    model: DecoderModel, batch: PackedBatch, *, with_logits: bool
) -> tuple[Tensor, Tensor | None]:
    """Logprob of each response token (and the logits predicting it), as the engine computes."""
    # the LM head reads the scored rows only: their logits are forward_logits(...)[rows]
    if batch.shared_prefixes is None:
        picked = model.forward_logits(batch.ids, batch.lengths, media=batch.media, rows=batch.rows)
    else:  # the samples of one prompt share its tokens (the same logits, the prompt once)
        picked = model.forward_logits(
            batch.ids, batch.lengths, rows=batch.rows, shared_prefixes=batch.shared_prefixes
        )
    logp = model.ops.log_softmax(picked).gather(1, batch.targets[:, None])[:, 0]
    return logp, (picked if with_logits else None)


def _reference_logprobs(policy: Policy, batch: PackedBatch) -> Tensor:
    with torch.no_grad(), policy.mode.reference(policy.model) as reference:
        return _response_logprobs(reference, batch, with_logits=False)[0]


def _entropy(logits: Tensor, settings: LossSettings) -> Tensor:
    """Per-row entropy; always reported, it joins the graph only when the loss uses it."""
    if settings.entropy_coef != 0.0:
        return entropy_from_logits(logits)
    with torch.no_grad():
        return entropy_from_logits(logits.detach())


def _micro_batch_objective(
    policy: Policy, part: Sequence[TrainSample], ctx: _StepContext
) -> tuple[PolicyObjective, int]:
    """The objective of one micro-batch on this rank (no context parallel), its loss tokens."""
    model, settings = policy.model, ctx.settings
    share = not ctx.rules.chunked_logprobs and model.takes_shared_prefixes()
    batch = pack(part, model.embedding.device, model, share_prompts=share)
    if ctx.rules.chunked_logprobs:
        # logprobs and entropies chunk by chunk from the hidden states: no [T, vocab] logits
        logp, entropy = model.forward_token_logprobs(
            batch.ids, batch.lengths, batch.rows, batch.targets, media=batch.media
        )
        if settings.entropy_coef == 0.0:
            entropy = entropy.detach()
    else:
        logp, logits = _response_logprobs(model, batch, with_logits=True)
        assert logits is not None
        entropy = _entropy(logits, settings)
    ref = _reference_logprobs(policy, batch) if ctx.cfg.use_kl_loss else None
    objective = policy_objective(
        logp=logp,
        old_logp=logp.detach(),
        advantages=batch.advantages,
        mask=batch.mask,
        lengths=batch.response_lengths,
        settings=settings,
        rollout_logp=batch.rollout,
        ref_logp=ref,
        entropy=entropy,
        global_batch_size=ctx.global_batch_size,
        global_token_count=ctx.global_token_count,
    )
    return objective, int(batch.mask.sum())


def _next_token_entropy(out: cp.ContextParallelOutput, settings: LossSettings) -> Tensor:
    """Entropy of the distribution each local token was drawn from: row t-1's, which a
    one-token halo brings over when another rank holds it (0 at a sequence's first token)."""
    rows = _entropy(out.logits, settings)[:, None]
    plan = cp.plan_halo(out.shard, 2)
    return cp.halo_windows(rows, cp.exchange_halo(rows, plan, name="entropy"), plan)[0, :, 0]


def _context_parallel_objective(
    policy: Policy, part: Sequence[TrainSample], ctx: _StepContext
) -> tuple[PolicyObjective, int]:
    """This rank's share of one micro-batch's objective under context parallel (the shares
    of the CP group add up to the micro-batch's objective), and its own loss tokens."""
    assert policy.parallel is not None
    if any(s.media for s in part):
        raise GrpoInputError(
            "context_parallel_size > 1 does not take multimodal samples (media placeholder "
            "runs would be split over ranks); train them with context_parallel_size=1"
        )
    group, settings = policy.parallel.cp_group, ctx.settings
    batch = pack_context_parallel(
        part, policy.cp_size, settings,
        capacity=policy.model.config.capacity,
        global_batch_size=ctx.global_batch_size, global_token_count=ctx.global_token_count,
    )  # fmt: skip
    out = cp.forward_context_parallel(policy.model, batch.ids, batch.lengths, group, CP_LAYOUT)
    device = out.logprobs.device

    mask, rollout, advantages, weights = (
        out.shard.split(values, name=name).to(device)
        for name, values in (("mask", batch.mask), ("rollout", batch.rollout),
                             ("advantages", batch.advantages), ("weights", batch.weights))
    )  # fmt: skip
    ref = None
    if ctx.cfg.use_kl_loss:
        with torch.no_grad(), policy.mode.reference(policy.model) as reference:
            ref = cp.forward_context_parallel(
                reference, batch.ids, batch.lengths, group, CP_LAYOUT
            ).logprobs
    objective = policy_objective(
        logp=out.logprobs,
        old_logp=out.logprobs.detach(),
        advantages=advantages,
        mask=mask,
        lengths=[out.logprobs.shape[0]],
        settings=settings,
        rollout_logp=rollout,
        ref_logp=ref,
        entropy=_next_token_entropy(out, settings),
        token_weights=weights,
    )
    return objective, int(mask.sum())


def compute_gradients(
    policy: Policy,
    samples: Sequence[TrainSample],
    cfg: GrpoConfig,
    *,
    global_batch_size: int,
    global_token_count: int,
) -> dict[str, float]:
    """Forward, loss, backward and gradient reduction of one step; no clipping, no update.

    Collective: every rank calls it (with its own samples, possibly none). Afterwards every
    trainable parameter holds the gradient of the global-batch loss (reduced over the ranks);
    returns the step's metrics (combined over ranks, the same dict everywhere) with
    ``grad_norm``, the global norm of those gradients. The policy's backend sets the rules
    (``TrainerBackend.step_rules``).
    """
    rules = policy.backend.step_rules(policy)
    ctx = _StepContext(
        cfg=cfg, settings=LossSettings.from_config(cfg), rules=rules,
        global_batch_size=global_batch_size, global_token_count=global_token_count,
    )  # fmt: skip
    model = policy.model
    parts = micro_batches(samples, cfg.micro_batch_size) if samples else []
    # Every rank must run the same number of forwards/backwards (FSDP's and expert parallel's
    # collectives): pad with empty ones.
    device = policy.model.embedding.device
    counts = torch.tensor([len(parts)], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    n_micro = max(int(counts), 1)
    parts += [[] for _ in range(n_micro - len(parts))]
    objective_of = _context_parallel_objective if policy.cp_size > 1 else _micro_batch_objective
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    tokens = 0
    with rules.accumulation(n_micro) as acc:
        for part in parts:
            with acc.micro_batch():
                if not part:  # a rank without samples still joins the collectives
                    (
                        model.forward_logits(torch.tensor([0], device=device), [1]).sum() * 0.0
                    ).backward()  # type: ignore[no-untyped-call]
                    continue
                objective, count = objective_of(policy, part, ctx)
                (objective.loss * rules.loss_scale).backward()  # type: ignore[no-untyped-call]
                tokens += count
                for key, value in objective.metrics.items():
                    if key in MAX_METRICS:
                        maxima[key] = max(maxima.get(key, 0.0), value)
                    elif key in SUM_METRICS:
                        sums[key] = sums.get(key, 0.0) + value
                    else:
                        sums[key] = sums.get(key, 0.0) + value * count
    norm = rules.reduce_gradients()
    if not rules.reports_metrics:
        sums, maxima, tokens = {}, {}, 0  # another rank of the group reports these samples
    metrics = _combine(sums, maxima, tokens)
    metrics["grad_norm"] = norm
    return metrics


def train_step(
    policy: Policy,
    samples: Sequence[TrainSample],
    cfg: GrpoConfig,
    *,
    global_batch_size: int,
    global_token_count: int,
) -> dict[str, float]:
    """Forward, loss, backward, gradient reduction (``compute_gradients``), clipping and one
    optimizer step.

    Collective: every rank calls it (with its own samples, possibly none). Returns the step's
    metrics, already combined over ranks (the same dict on every rank). The samples are split
    into micro-batches of ``cfg.micro_batch_size``.
    """
    metrics = compute_gradients(
        policy, samples, cfg,
        global_batch_size=global_batch_size, global_token_count=global_token_count,
    )  # fmt: skip
    norm = metrics["grad_norm"]
    scale_grads_to_norm(policy.trainable(), norm, cfg.max_grad_norm)
    if math.isfinite(norm):
        policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    metrics["skipped_step"] = 0.0 if math.isfinite(norm) else 1.0
    return metrics


def _combine(sums: dict[str, float], maxima: dict[str, float], tokens: int) -> dict[str, float]:
    """Sum (and max) the per-rank metrics over the world; per-token means weighted by tokens."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sums, maxima, tokens))
    total_tokens = sum(t for _, _, t in gathered)
    keys = sorted({k for s, _, _ in gathered for k in s})
    out: dict[str, float] = {}
    for key in keys:
        value = math.fsum(s.get(key, 0.0) for s, _, _ in gathered)
        out[key] = value if key in SUM_METRICS else value / max(total_tokens, 1)
    for key in sorted({k for _, m, _ in gathered for k in m}):
        out[key] = max(m.get(key, 0.0) for _, m, _ in gathered)
    out["train_tokens"] = float(total_tokens)
    return out
