"""policy_objective: the loss terms composed per config, and metrics that never move the loss."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.grpo import GrpoConfig, GrpoInputError
from posttrain.grpo.losses import (
    aggregate_loss,
    entropy_from_logits,
    importance_weights,
    kl_penalty,
    ppo_clip_loss,
)
from posttrain.grpo.objective import LossSettings, policy_objective

LENGTHS = [3, 2, 4]


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    old = -torch.rand(t, generator=g) * 3
    return {
        "logp": (old + 0.3 * torch.randn(t, generator=g)).requires_grad_(True),
        "old_logp": old,
        "advantages": torch.randn(t, generator=g),
        "mask": torch.rand(t, generator=g) > 0.2,
        "rollout_logp": old + 0.05 * torch.randn(t, generator=g),
        "ref_logp": old + 0.1 * torch.randn(t, generator=g),
    }


def test_settings_from_config() -> None:
    cfg = GrpoConfig(clip_high=0.28, tis="icepop", loss_aggregation="token_mean", kl_type="k3")
    s = LossSettings.from_config(cfg)
    assert (s.clip_high, s.tis, s.aggregation, s.kl_type) == (0.28, "icepop", "token_mean", "k3")
    assert LossSettings() == LossSettings.from_config(GrpoConfig())  # the config's defaults


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["token_mean", "seq_mean_token_mean"]))
def test_rollout_logprobs_with_tis_off_change_metrics_only(seed: int, agg: str) -> None:
    b = batch(seed)
    s = LossSettings(aggregation=agg)  # type: ignore[arg-type]
    plain = policy_objective(
        logp=b["logp"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"],
        lengths=LENGTHS, settings=s,
    )  # fmt: skip
    with_metrics = policy_objective(
        logp=b["logp"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"],
        lengths=LENGTHS, settings=s, rollout_logp=b["rollout_logp"],
    )  # fmt: skip
    assert torch.equal(plain.loss, with_metrics.loss)
    assert "train_rollout_logprob_abs_diff" not in plain.metrics
    assert with_metrics.metrics["train_rollout_logprob_abs_diff"] > 0
    (g1,) = torch.autograd.grad(plain.loss, b["logp"])
    (g2,) = torch.autograd.grad(with_metrics.loss, b["logp"])
    assert torch.equal(g1, g2)


def test_full_objective_is_the_sum_of_its_terms() -> None:
    b = batch(3)
    logits = torch.randn(sum(LENGTHS), 11, requires_grad=True)
    ent = entropy_from_logits(logits)
    s = LossSettings(
        clip_high=0.3, dual_clip=3.0, use_kl_loss=True, kl_coef=0.1, kl_type="low_var_kl",
        entropy_coef=0.01, tis="tis", tis_clip_high=1.5,
    )  # fmt: skip
    out = policy_objective(
        logp=b["logp"], old_logp=b["old_logp"], advantages=b["advantages"], mask=b["mask"],
        lengths=LENGTHS, settings=s, rollout_logp=b["rollout_logp"], ref_logp=b["ref_logp"],
        entropy=ent,
    )  # fmt: skip

    def agg(x: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(x, b["mask"], LENGTHS, mode="seq_mean_token_mean")

    pl = ppo_clip_loss(
        b["logp"], b["old_logp"], b["advantages"], b["mask"], clip_high=0.3, dual_clip=3.0
    )
    w = importance_weights(b["old_logp"], b["rollout_logp"], mode="tis", clip_high=1.5)
    want = (
        agg(pl.loss * w)
        + 0.1 * agg(kl_penalty(b["logp"], b["ref_logp"], "low_var_kl"))
        - 0.01 * agg(ent)
    )
    torch.testing.assert_close(out.loss, want)
    for key in ("ppo_kl", "pg_clipfrac", "tis_weight_mean", "kl_loss", "entropy", "pg_loss"):
        assert key in out.metrics
    assert out.metrics["loss"] == pytest.approx(float(want.detach()))
    out.loss.backward()
    assert logits.grad is not None
    assert b["logp"].grad is not None


def test_missing_inputs_are_named() -> None:
    b = batch(0)
    common = {
        "logp": b["logp"], "old_logp": b["old_logp"], "advantages": b["advantages"],
        "mask": b["mask"], "lengths": LENGTHS,
    }  # fmt: skip
    with pytest.raises(GrpoInputError, match="rollout_logp"):
        policy_objective(**common, settings=LossSettings(tis="tis"))  # type: ignore[arg-type]
    with pytest.raises(GrpoInputError, match="ref_logp"):
        policy_objective(**common, settings=LossSettings(use_kl_loss=True, kl_coef=0.1))  # type: ignore[arg-type]
    with pytest.raises(GrpoInputError, match="entropy"):
        policy_objective(**common, settings=LossSettings(entropy_coef=0.1))  # type: ignore[arg-type]
