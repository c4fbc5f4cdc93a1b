"""Rank functions for the megatron-backend tests (forked gloo ranks; see test_grpo_megatron)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from grpo_workers import cp_samples

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.trainer import Policy, build_policy, compute_gradients
from posttrain.lora import export_adapter, load_peft
from posttrain.models import load_pretrained, to_hf_state_dict

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config(ckpt: str, world: int, train: str, **options: Any) -> GrpoConfig:
    options.setdefault("lora_targets", ALL_TARGETS)
    return GrpoConfig(
        model_path=Path(ckpt), train=train, replicate=1, shard=world, lr=1e-3,  # type: ignore[arg-type]
        **options,
    )  # fmt: skip


def _lora_grads(policy: Policy) -> dict[str, torch.Tensor]:
    """The adapter's gradients under their PEFT names, full size (gathered like the factors)."""
    assert policy.lora is not None
    params = list(policy.lora.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        return export_adapter(policy.lora)
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def _full_grads(policy: Policy) -> dict[str, torch.Tensor]:
    model = policy.model
    if policy.backend.name == "megatron":
        return to_hf_state_dict(model.full_state_dict(grads=True), model.full_config)  # type: ignore[attr-defined]
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return to_hf_state_dict(grads, model.config)


def _weights(policy: Policy) -> dict[str, torch.Tensor]:
    if policy.lora is not None:
        return export_adapter(policy.lora)
    if policy.backend.name == "megatron":
        return policy.model.hf_state_dict()
    from posttrain.fsdp_mesh import iter_full_state_dict

    return to_hf_state_dict(dict(iter_full_state_dict(policy.model)), policy.model.config)


def one_step(cfg: GrpoConfig, ckpt: str, adapter: str | None) -> dict[str, Any]:
    """Gradients of one GRPO step (LoRA factors loaded from ``adapter``: B is non-zero), and
    the exported weights before any update."""
    policy = build_policy(cfg)
    if policy.lora is not None and adapter is not None:
        load_peft(policy.lora, adapter, strict=True)
    batch = cp_samples(ckpt)
    masked = sum(sum(s.loss_mask) for s in batch)
    exported = _weights(policy)
    metrics = compute_gradients(
        policy, policy.data_parallel_share(batch), cfg,
        global_batch_size=len(batch), global_token_count=masked,
    )  # fmt: skip
    grads = _lora_grads(policy) if policy.lora is not None else _full_grads(policy)
    dist.barrier()
    return {"metrics": metrics, "grads": grads, "weights": exported}


def parity_suite(rank: int, world: int, ckpt: str, adapter: str, runs: list[dict[str, Any]]) -> Any:
    """Each run (``train`` plus GrpoConfig options) in turn on these ranks."""
    torch.set_num_threads(1)
    out = []
    for run in runs:
        options = dict(run)
        train = options.pop("train")
        out.append(one_step(config(ckpt, world, train, **options), ckpt, adapter))
    return out if rank == 0 else None


def save_then_reload(
    rank: int, world: int, ckpt: str, out: str, tp: int, ep: int = 1, train: str = "full"
) -> Any:
    """TP=``tp`` x EP=``ep`` policy: one step, checkpoint; the gathered weights (full: the HF
    weights; LoRA: the adapter) and logprobs."""
    torch.set_num_threads(1)
    from posttrain.grpo import checkpoint
    from posttrain.grpo.trainer import train_step

    cfg = config(ckpt, world, train, backend="megatron", tensor_model_parallel_size=tp,
                 expert_model_parallel_size=ep)  # fmt: skip
    policy = build_policy(cfg)
    batch = cp_samples(ckpt)
    masked = sum(sum(s.loss_mask) for s in batch)
    train_step(policy, policy.data_parallel_share(batch), cfg,
               global_batch_size=len(batch), global_token_count=masked)  # fmt: skip
    path = checkpoint.save(Path(out), 0, policy, {"next_step": 1, "data_position": 0})
    ids = torch.tensor(batch[0].tokens)
    with torch.no_grad():
        logprobs = policy.model.forward_logprobs(ids, [len(batch[0].tokens)])
    weights = _weights(policy)
    dist.barrier()
    return {"path": str(path), "logprobs": logprobs, "weights": weights} if rank == 0 else None


def load_under(
    rank: int, world: int, ckpt: str, saved: str, tp: int, ep: int = 1, train: str = "full"
) -> Any:
    """A fresh TP=``tp`` x EP=``ep`` policy resumed from ``saved``: its weights and logprobs."""
    torch.set_num_threads(1)
    from posttrain.grpo.megatron import checkpoint

    cfg = config(ckpt, world, train, backend="megatron", tensor_model_parallel_size=tp,
                 expert_model_parallel_size=ep)  # fmt: skip
    policy = build_policy(cfg)
    restored = checkpoint.load(Path(saved), policy)  # whether the optimizer came back too
    batch = cp_samples(ckpt)
    ids = torch.tensor(batch[0].tokens)
    with torch.no_grad():
        logprobs = policy.model.forward_logprobs(ids, [len(batch[0].tokens)])
        single = None
        if train == "full":
            single = load_pretrained(Path(saved) / "model").forward_logprobs(ids, [len(ids)])
    weights = _weights(policy)
    dist.barrier()
    if rank:
        return None
    return {"extra": restored, "logprobs": logprobs, "single": single, "weights": weights}


def sync_full(rank: int, world: int, ckpt: str, tp: int, sp: bool) -> Any:
    """A TP=``tp`` full-training policy pushes its weights to an in-process sink (rank 0 sends):
    what the sink received."""
    torch.set_num_threads(1)
    from grpo_workers import RecordingSink

    from posttrain.grpo.fleet import EngineFleet, SyncTarget

    cfg = config(ckpt, world, "full", backend="megatron", tensor_model_parallel_size=tp,
                 sequence_parallel=sp)  # fmt: skip
    policy = build_policy(cfg)
    sink = RecordingSink()
    with EngineFleet(SyncTarget(engine_urls=(), sinks=(sink,))) as fleet:
        result = fleet.sync(policy, 7, first=True)
    dist.barrier()
    if rank:
        return None
    assert sink.version is not None
    return {"received": sink.received, "version": sink.version,
            "bytes": result.metrics["sync_bytes"]}  # fmt: skip


def replicas_after_a_step(rank: int, world: int, ckpt: str, train: str, sp: bool) -> bool:
    """After one TP=2 train step, every tensor replicated over TP (full: the base weights
    outside the split linears; LoRA: the unsharded factors) is bitwise equal on both ranks."""
    torch.set_num_threads(1)
    from posttrain.grpo.trainer import train_step
    from posttrain.lora import verify_replicas

    cfg = config(ckpt, world, train, backend="megatron", tensor_model_parallel_size=2,
                 sequence_parallel=sp)  # fmt: skip
    policy = build_policy(cfg)
    batch = cp_samples(ckpt)
    masked = sum(sum(s.loss_mask) for s in batch)
    train_step(policy, policy.data_parallel_share(batch), cfg,
               global_batch_size=len(batch), global_token_count=masked)  # fmt: skip
    if policy.lora is not None:
        verify_replicas(policy.lora)  # raises ReplicaMismatchError naming the tensor and rank
        return True
    flat = torch.cat(
        [p.detach().reshape(-1).float() for p in policy.model.replicated_parameters().values()]
    )  # type: ignore[attr-defined]
    both = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(both, flat)
    return all(torch.equal(b, flat) for b in both)


def without_tp_sums(rank: int, world: int, ckpt: str, adapter: str) -> Any:
    """Negative control: the TP=2 step with the TP SUM of partial grads left out."""
    torch.set_num_threads(1)
    from posttrain.grpo.megatron import grads

    grads.tp_partial_parameters = lambda model: []  # type: ignore[assignment]
    cfg = config(ckpt, world, "full", backend="megatron", tensor_model_parallel_size=2)
    out = one_step(cfg, ckpt, adapter)
    return out if rank == 0 else None
