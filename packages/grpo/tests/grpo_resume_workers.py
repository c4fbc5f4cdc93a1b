"""Rank function for the resume regression test (trap 1 of issue 25: fp32 masters order).

A mixed-precision optimizer keeps fp32 master copies of the parameters and every ``step()``
starts from them: it updates the masters and copies them back over the parameters. If the
masters are snapshotted before a resume (or an initial adapter load) writes into the
parameters, the first step silently restores the stale values. grpo keeps no separate masters:
FSDP2's sharded fp32 parameters are the masters (``precision="bf16"`` only casts the compute
copy), so ``checkpoint.load`` writes straight into what the optimizer steps. ``fp32_masters``
below models the mixed-precision optimizer with step hooks, so the test can put masters in
either order and show that only the buggy one is caught.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo import checkpoint
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.trainer import Policy, TrainSample, build_policy, train_step
from posttrain.lora import export_adapter
from posttrain.models import DecoderModel, load_pretrained

PROMPT, RESPONSE, N = 5, 4, 4
VARIANTS = ("no_masters", "masters_after_load", "masters_before_load")


def _samples(ckpt: str, seed: int, model: DecoderModel | None = None) -> list[TrainSample]:
    """Four samples with ``model``'s logprobs (default: the checkpoint's) as the rollout's and
    mixed advantages."""
    model = load_pretrained(ckpt) if model is None else model
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N):
        toks = torch.randint(4, 90, (PROMPT + RESPONSE,), generator=gen).tolist()
        with torch.no_grad():
            lp = model.forward_logprobs(torch.tensor(toks), [len(toks)])[PROMPT:].tolist()
        out.append(TrainSample(tokens=toks, prompt_len=PROMPT, loss_mask=[1] * RESPONSE,
                               rollout_logprobs=lp, advantages=[(-1.0) ** i] * RESPONSE))  # fmt: skip
    return out


def fp32_masters(policy: Policy) -> None:
    """Give the policy's optimizer fp32 master weights, snapshotted from the parameters now:
    each step starts from the masters (copied over the parameters) and the stepped parameters
    become the new masters, as a mixed-precision optimizer does."""
    params = [p for group in policy.optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        masters = [p.detach().clone().float() for p in params]

    def start_from_masters(*_: Any) -> None:
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)

    def keep_as_masters(*_: Any) -> None:
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                m.copy_(p)

    policy.optimizer.register_step_pre_hook(start_from_masters)
    policy.optimizer.register_step_post_hook(keep_as_masters)


def _weights(policy: Policy) -> dict[str, Tensor]:
    if policy.lora is not None:
        return {k: v.clone() for k, v in export_adapter(policy.lora).items()}
    return {k: v.clone() for k, v in iter_full_state_dict(policy.model)}


def resume_then_step(
    rank: int, world: int, ckpt: str, out: str, train: str, precision: str
) -> dict[str, Any]:
    """Train one step and checkpoint it (run A), take A's next step as the reference; then,
    per variant, build a fresh policy, resume from A's checkpoint and take the same step."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), train=train, precision=precision, replicate=1,  # type: ignore[arg-type]
                     shard=world, lr=1e-2, seed=0)  # fmt: skip
    first, second = _samples(ckpt, 1), _samples(ckpt, 2)
    step = {"global_batch_size": N, "global_token_count": N * RESPONSE}
    run_a = build_policy(cfg)
    initial = _weights(run_a)
    train_step(run_a, first[rank::world], cfg, **step)
    path = checkpoint.save(Path(out), 1, run_a, {"next_step": 2})
    loaded = _weights(run_a)
    train_step(run_a, second[rank::world], cfg, **step)
    reference = _weights(run_a)
    results: dict[str, Any] = {"initial": initial, "loaded": loaded, "reference": reference}
    for variant in VARIANTS:
        resumed = build_policy(copy.copy(cfg))
        if variant == "masters_before_load":
            fp32_masters(resumed)  # the bug: masters copied before the loaded values exist
        checkpoint.load(path, resumed)
        if variant == "masters_after_load":
            fp32_masters(resumed)
        at_load = _weights(resumed)
        metrics = train_step(resumed, second[rank::world], cfg, **step)
        results[variant] = {"at_load": at_load, "after_step": _weights(resumed), "metrics": metrics}
    return results
