"""Rank functions for the multi-rank trainer tests (forked gloo ranks, see conftest)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.fsdp_mesh import iter_full_state_dict
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.trainer import TrainSample, build_policy, train_step
from posttrain.lora import export_adapter
from posttrain.models import (
    VOCAB_SIZE,
    LoraAdapter,
    ModelConfig,
    build_model,
    build_tokenizer,
    load_pretrained,
    to_hf_state_dict,
)

PROMPT, RESPONSE, N = 6, 5, 4


def save_tiny_checkpoint(path: Path, *, max_positions: int = 64, seed: int = 3) -> str:
    """A tiny Dense/MoE checkpoint (HF layout, with its tokenizer) at ``path``."""
    config = ModelConfig.tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=max_positions)
    build_model(config, seed=seed).save_pretrained(path, tokenizer=build_tokenizer())
    return str(path)


def tokens(i: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randint(4, 90, (PROMPT + RESPONSE,), generator=gen).tolist()


def engine_logprobs(
    ckpt: str, seqs: list[list[int]], *, lora: Any = None, hf: Any = None
) -> list[list[float]]:
    """What an engine serving these weights reports for the response tokens."""
    engine = load_pretrained(ckpt)
    if hf is not None:
        engine.load_hf_state_dict(hf)
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = engine.forward_logprobs(torch.tensor(s), [len(s)], lora=lora)
            out.append(lp[PROMPT:].tolist())
    return out


def samples(rollout: list[list[float]], advantages: list[float]) -> list[TrainSample]:
    return [
        TrainSample(
            tokens=tokens(i),
            prompt_len=PROMPT,
            loss_mask=[1] * RESPONSE,
            rollout_logprobs=rollout[i],
            advantages=[advantages[i]] * RESPONSE,
        )
        for i in range(N)
    ]


def two_steps(rank: int, world: int, ckpt: str, train: str) -> dict[str, Any]:
    """Step 1 from the checkpoint's logprobs; sync; step 2 from the synced engine's logprobs."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(
        model_path=Path(ckpt),
        train=train,
        replicate=1,
        shard=world,
        lr=1e-2,  # type: ignore[arg-type]
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    )
    policy = build_policy(cfg)
    seqs = [tokens(i) for i in range(N)]
    adv = [1.0, -1.0, 0.5, -0.5]
    rollout = engine_logprobs(ckpt, seqs)
    mine = samples(rollout, adv)[rank::world]
    first = train_step(policy, mine, cfg, global_batch_size=N, global_token_count=N * RESPONSE)
    if policy.lora is not None:
        adapter = export_adapter(policy.lora)
        lora = LoraAdapter.from_peft_state_dict(adapter, scaling=cfg.lora_scaling)
        rollout = engine_logprobs(ckpt, seqs, lora=lora)
        weights = {k: v.clone() for k, v in adapter.items()}
    else:
        full = dict(iter_full_state_dict(policy.model))
        hf = to_hf_state_dict(full, policy.model.config)
        rollout = engine_logprobs(ckpt, seqs, hf=hf)
        weights = full
    mine = samples(rollout, adv)[rank::world]
    second = train_step(policy, mine, cfg, global_batch_size=N, global_token_count=N * RESPONSE)
    dist.barrier()
    return {"first": first, "second": second, "weights": weights}


def write_then_step(rank: int, world: int, ckpt: str, train: str) -> bool:
    """G8: a write into the parameters after the optimizer exists (a resume) is what the next
    step starts from: with lr 0 the written values survive the step exactly."""
    cfg = GrpoConfig(model_path=Path(ckpt), train=train, replicate=1, shard=world)  # type: ignore[arg-type]
    policy = build_policy(cfg)
    params = policy.trainable()
    written = []
    with torch.no_grad():
        for i, p in enumerate(params):
            value = torch.full_like(p, 0.01 * (i + 1))
            p.copy_(value)
            written.append(value.full_tensor() if hasattr(value, "full_tensor") else value)
    for group in policy.optimizer.param_groups:
        group["lr"] = 0.0
    seqs = [tokens(i) for i in range(N)]
    rollout = [[0.0] * RESPONSE for _ in seqs]
    train_step(policy, samples(rollout, [1.0, -1.0, 0.5, -0.5])[rank::world], cfg,
               global_batch_size=N, global_token_count=N * RESPONSE)  # fmt: skip
    after = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    return all(torch.equal(a.detach(), w) for a, w in zip(after, written, strict=True))


# --------------------------------------------------------------- context parallel (one step)

CP_PROMPTS = (4, 7, 5, 6, 3, 5)  # six samples, lengths 9..13: padded to multiples of 2C
CP_RESPONSES = (5, 3, 8, 4, 6, 7)


def cp_samples(ckpt: str) -> list[TrainSample]:
    """Six samples of different lengths, some response tokens masked out, per-token advantages
    and the checkpoint's own logprobs as the rollout's (so TIS weights and parity are real)."""
    model = load_pretrained(ckpt)
    gen = torch.Generator().manual_seed(7)
    out = []
    for i, (p, r) in enumerate(zip(CP_PROMPTS, CP_RESPONSES, strict=True)):
        toks = torch.randint(4, 90, (p + r,), generator=gen).tolist()
        with torch.no_grad():
            lp = model.forward_logprobs(torch.tensor(toks), [p + r])[p:].tolist()
        mask = [0 if (j + i) % 4 == 3 else 1 for j in range(r)]
        adv = (torch.randn(r, generator=gen) * 0.5 + (1.0 if i % 2 else -1.0)).tolist()
        out.append(TrainSample(tokens=toks, prompt_len=p, loss_mask=mask,
                               rollout_logprobs=lp, advantages=adv))  # fmt: skip
    return out


def cp_step(rank: int, world: int, ckpt: str, cp_size: int, options: dict[str, Any]) -> Any:
    """One GRPO step on ``world`` ranks with ``context_parallel_size=cp_size``: the step's
    metrics and the updated trainable weights (full tensors)."""
    torch.set_num_threads(1)
    cfg = GrpoConfig(
        model_path=Path(ckpt), replicate=1, shard=world, context_parallel_size=cp_size,
        lr=1e-3, seed=0, **options,
    )  # fmt: skip
    policy = build_policy(cfg)
    batch = cp_samples(ckpt)
    mine = policy.data_parallel_share(batch)
    masked = sum(sum(s.loss_mask) for s in batch)
    metrics = train_step(policy, mine, cfg, global_batch_size=len(batch), global_token_count=masked)
    if policy.lora is not None:
        weights = {k: v.clone() for k, v in export_adapter(policy.lora).items()}
    else:
        weights = dict(iter_full_state_dict(policy.model))
    dist.barrier()
    return {"metrics": metrics, "weights": weights, "samples": [len(s.tokens) for s in mine]}


class RecordingSink:
    """An in-process ``WeightSink`` (a user's engine): keeps what arrives, or refuses."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.version: int | None = None
        self.lora_name: str | None = None
        self.received: dict[str, torch.Tensor] = {}

    def update_weights(
        self,
        tensors: Mapping[str, Any],
        *,
        weight_version: int,
        lora_name: str | None = None,
        lora_config: Mapping[str, Any] | None = None,
    ) -> None:
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.received = {k: v.clone() for k, v in tensors.items()}
        self.version, self.lora_name = weight_version, lora_name


def per_layer_steps(rank: int, world: int, ckpt: str, options: dict[str, Any]) -> dict[str, Any]:
    """Two full-training steps with ``options`` (numerics, precision, activation
    checkpointing, compile) on the same samples; the full weights after, the metrics, the FSDP
    units (one per decoder layer, then the root), whether the layers ran compiled and the
    graph breaks dynamo met (their reasons)."""
    from torch.distributed.fsdp import FSDPModule

    from posttrain.models import layers_compiled

    torch.set_num_threads(1)
    cfg = GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=world, lr=1e-2, **options)  # type: ignore[arg-type]  # fmt: skip
    policy = build_policy(cfg)
    units = [name for name, m in policy.model.named_modules() if isinstance(m, FSDPModule)]
    seqs = [tokens(i) for i in range(N)]
    mine = samples(engine_logprobs(ckpt, seqs), [1.0, -1.0, 0.5, -0.5])[rank::world]
    steps = [
        train_step(policy, mine, cfg, global_batch_size=N, global_token_count=N * RESPONSE)
        for _ in range(2)
    ]
    weights = dict(iter_full_state_dict(policy.model))
    dist.barrier()
    compiled = layers_compiled(policy.model)
    breaks = sorted(torch._dynamo.utils.counters["graph_break"])  # this process's, by reason
    return {
        "steps": steps, "weights": weights, "units": units, "compiled": compiled,
        "graph_breaks": breaks,
    }  # fmt: skip
