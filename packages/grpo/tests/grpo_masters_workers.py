"""Rank function for ``test_grpo_masters.py``: full training of a bf16 checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from grpo_resume_workers import RESPONSE, N, _samples
from torch import Tensor

from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo import checkpoint
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.masters import MasterAdamW
from posttrain.grpo.trainer import (
    Policy,
    build_policy,
    compute_gradients,
    train_step,
)
from posttrain.models import load_pretrained, to_hf_state_dict


def weights(policy: Policy) -> dict[str, Tensor]:
    """The fp32 masters: FSDP's parameters, or the megatron backend's ``MasterAdamW`` copies."""
    if isinstance(policy.optimizer, MasterAdamW):
        return {f"master.{i}": m.clone() for i, m in enumerate(policy.optimizer.masters)}
    return {k: v.clone() for k, v in iter_full_state_dict(policy.model)}


def sent_weights(policy: Policy, final: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the weight sync converts (HF names, the engine's dtype)."""
    if policy.backend.name == "megatron":
        return policy.model.hf_state_dict()
    return to_hf_state_dict(final, policy.model.config)


def bf16_full_training(
    rank: int, world: int, ckpt: str, out: str, lr: float, backend: str
) -> dict[str, Any]:
    """Three steps at ``lr`` (run A, checkpointed after the first); the same last two steps
    from a fresh policy resumed from that checkpoint; what the engine would be sent."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=world, lr=lr,
                     seed=0, max_grad_norm=1e9, backend=backend)  # type: ignore[arg-type]  # fmt: skip
    batches = [_samples(ckpt, s)[rank::world] for s in (1, 2, 3)]
    step = {"global_batch_size": N, "global_token_count": N * RESPONSE}
    run_a = build_policy(cfg)
    initial = weights(run_a)
    train_step(run_a, batches[0], cfg, **step)
    path = checkpoint.save(Path(out), 1, run_a, {"next_step": 2})
    for batch in batches[1:]:
        train_step(run_a, batch, cfg, **step)
    final = weights(run_a)
    sent = sent_weights(run_a, final)
    engine = load_pretrained(ckpt)
    engine.load_hf_state_dict(sent)  # in the engine's dtype: it takes them as they are
    served = _samples(ckpt, 4, engine)[rank::world]
    parity = compute_gradients(run_a, served, cfg, **step)  # the trainer's forward vs engine's
    resumed = build_policy(cfg)
    checkpoint.load(path, resumed)
    for batch in batches[1:]:
        train_step(resumed, batch, cfg, **step)
    return {
        "initial": initial,
        "final": final,
        "resumed": weights(resumed),
        "sent_dtypes": sorted({str(t.dtype) for t in sent.values()}),
        "parity": parity,
    }
