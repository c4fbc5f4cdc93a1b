"""Rank functions for the resume hardening tests: save a checkpoint after one step, load
checkpoint directories (intact or tampered) into a fresh policy and report what happened."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from grpo_resume_workers import RESPONSE, N, _samples, _weights

from posttrain.grpo import checkpoint
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.trainer import Policy, build_policy, train_step


def _cfg(ckpt: str, train: str, world: int) -> GrpoConfig:
    return GrpoConfig(model_path=Path(ckpt), train=train, precision="fp32", replicate=1,  # type: ignore[arg-type]
                      shard=world, lr=1e-2, seed=0)  # fmt: skip


def _digest(policy: Policy) -> dict[str, Any]:
    """Weights, optimizer tensors and the RNG state, as comparable values."""
    h = hashlib.sha256()
    for _, v in sorted(policy.optimizer.state_dict()["state"].items()):
        for key, t in sorted(v.items()):
            h.update(key.encode())
            if isinstance(t, torch.Tensor):
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                h.update(full.detach().float().numpy().tobytes())
            else:
                h.update(repr(t).encode())
    return {
        "weights": _weights(policy),
        "optim": h.hexdigest(),
        "rng": torch.get_rng_state().clone(),
    }


def save_after_step(rank: int, world: int, ckpt: str, out: str, train: str) -> dict[str, Any]:
    """One training step, then checkpoint 1 under ``out``; the state saved, for comparison."""
    torch.set_num_threads(1)
    cfg = _cfg(ckpt, train, world)
    policy = build_policy(cfg)
    step = {"global_batch_size": N, "global_token_count": N * RESPONSE}
    train_step(policy, _samples(ckpt, 1)[rank::world], cfg, **step)
    path = checkpoint.save(Path(out), 1, policy, {"next_step": 2, "data_position": 3})
    return {"path": str(path), **_digest(policy)}


def load_each(rank: int, world: int, ckpt: str, train: str, dirs: list[str]) -> list[Any]:
    """Load each directory into a fresh policy: its digest, or the GrpoRunError's message."""
    torch.set_num_threads(1)
    out: list[Any] = []
    for d in dirs:
        policy = build_policy(_cfg(ckpt, train, world))
        torch.manual_seed(12345)  # an RNG state the load must replace
        try:
            extra = checkpoint.load(Path(d), policy)
        except GrpoRunError as exc:
            out.append(str(exc))
            continue
        out.append({"extra": extra, **_digest(policy)})
    return out


def poisoned_full_round_trip(rank: int, world: int, ckpt: str, out: str, value: float) -> str:
    """Save full weights with one entry set to ``value`` (through DCP, manifest and all), then
    load them into a fresh policy: the GrpoRunError's message (the load must refuse)."""
    torch.set_num_threads(1)
    policy = build_policy(_cfg(ckpt, "full", world))
    with torch.no_grad():
        name, param = next(iter(policy.model.named_parameters()))
        getattr(param, "_local_tensor", param).view(-1)[0] = value
    path = checkpoint.save(Path(out), 1, policy, {"next_step": 2, "data_position": 0})
    fresh = build_policy(_cfg(ckpt, "full", world))
    try:
        checkpoint.load(path, fresh)
    except GrpoRunError as exc:
        return f"{name}: {exc}"
    return "loaded"
