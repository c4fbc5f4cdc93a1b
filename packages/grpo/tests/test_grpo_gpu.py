"""The GRPO math on a CUDA device (skipped without one): results stay on the inputs' device,
match the CPU within float32 tolerance, and gradients agree."""

from __future__ import annotations

import pytest
import torch

from posttrain.grpo import (
    GrpoConfig,
    LossSettings,
    aggregate_loss,
    entropy_from_logits,
    expand_to_tokens,
    group_normalized_advantages,
    importance_weights,
    mismatch_metrics,
    policy_objective,
    whiten_advantages,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [5, 0, 7, 3, 9]


def inputs(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    t = sum(LENGTHS)
    old = -torch.rand(t, generator=g) * 4
    batch = {
        "rewards": torch.rand(len(LENGTHS), generator=g).round(),
        "old": old,
        "new": old + 0.2 * torch.randn(t, generator=g),
        "rollout": old + 0.01 * torch.randn(t, generator=g),
        "ref": old + 0.1 * torch.randn(t, generator=g),
        "mask": torch.rand(t, generator=g) > 0.1,
        "logits": torch.randn(t, 257, generator=g) * 3,
    }
    return {k: v.to(device) for k, v in batch.items()}


def objective(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    b = inputs(device)
    adv_seq = group_normalized_advantages(b["rewards"], [0, 0, 1, 1, 1])
    assert adv_seq.device.type == device
    adv = whiten_advantages(expand_to_tokens(adv_seq, LENGTHS), b["mask"])
    logp = b["new"].clone().requires_grad_(True)
    logits = b["logits"].clone().requires_grad_(True)
    cfg = GrpoConfig(
        tis="icepop", use_kl_loss=True, kl_coef=0.05, kl_type="low_var_kl", entropy_coef=1e-3,
        dual_clip=3.0,
    )  # fmt: skip
    out = policy_objective(
        logp=logp, old_logp=b["old"], advantages=adv, mask=b["mask"], lengths=LENGTHS,
        settings=LossSettings.from_config(cfg), rollout_logp=b["rollout"],
        ref_logp=b["ref"], entropy=entropy_from_logits(logits),
    )  # fmt: skip
    assert out.loss.device.type == device
    out.loss.backward()
    assert logp.grad is not None
    assert logits.grad is not None
    return out.loss.detach().cpu(), logp.grad.cpu(), logits.grad.cpu(), out.metrics


def test_objective_on_cuda_matches_cpu() -> None:
    cpu, gpu = objective("cpu"), objective("cuda")
    for a, b in zip(cpu[:3], gpu[:3], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for key, value in cpu[3].items():
        assert gpu[3][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_pieces_stay_on_the_device() -> None:
    b = inputs("cuda")
    w = importance_weights(b["old"], b["rollout"], mode="tis", mask=b["mask"])
    assert w.device.type == "cuda"
    assert aggregate_loss(b["new"], b["mask"], LENGTHS, mode="seq_mean_token_mean").is_cuda
    metrics = mismatch_metrics(b["old"], b["old"], b["mask"])
    assert metrics["train_rollout_logprob_abs_diff"] == 0.0
    assert metrics["train_rollout_logprob_equal_frac"] == 1.0
