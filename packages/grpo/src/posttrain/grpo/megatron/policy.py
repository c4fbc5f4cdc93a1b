"""The GRPO policy on the megatron backend: build it, adapt it, and choose its LoRA targets.

``build_megatron_policy`` loads the same HF checkpoint the fsdp backend loads into a
``TensorParallelDecoder`` (each rank keeps its tensor-parallel slices), optionally attaches
lora-core adapters to its megatron-core parallel linears (``attach_lora`` with the TP and DP
groups: lora-core's rank-r rules for column and row layouts, with and without sequence
parallelism), and builds the optimizer. The data-parallel share of a step goes by ``dp_rank``
(the ranks of one TP group train on the same samples).

Departures from a Megatron-LM trainer: no distributed optimizer and no DDP buckets; gradients
are reduced explicitly after the backward (``grads``), every rank steps its own AdamW over
its local tensors (replicated tensors get identical updates on every rank). ``--bf16`` does
not cast: the decoder computes in fp32 from parameters in the checkpoint's dtype.

Only the fused attention and dense-MLP linears are split over TP; a LoRA target on a
replicated linear (the MoE router ``gate``, ``lm_head``) is refused under TP > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from posttrain.fsdp_mesh import build_fsdp_mesh
from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.backend import (
    AdapterTraining,
    DataContextParallel,
    FullTraining,
    Policy,
    TrainerBackend,
    TrainMode,
)
from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.masters import MasterAdamW, needs_masters
from posttrain.grpo.megatron.groups import ParallelGroups, build_parallel_groups
from posttrain.grpo.megatron.model import TensorParallelDecoder
from posttrain.interface import MeshSpec
from posttrain.lora import LoraConfig, LoraGroups, Target, attach_lora
from posttrain.models import Numerics, load_config, load_hf_tensors


def _site_path(name: str) -> str:
    """``layers.3.qkv`` (a fused weight's name) -> ``layers.3.sites.qkv`` (its site module);
    an MLA projection's ``layers.3.self_attn.kv_b_proj`` -> ``layers.3.sites.kv_b_proj``."""
    layers, index, *_, param = name.split(".")
    return f"{layers}.{index}.sites.{param}"


def megatron_lora_targets(
    model: TensorParallelDecoder, suffixes: Sequence[str]
) -> tuple[dict[str, Target], list[str]]:
    """lora-core ``Target``s for the sites whose PEFT modules end with ``suffixes``, and the PEFT
    ``target_modules``. Fused sites (qkv, gate/up) are adapted whole: one A, a B whose local
    rows are this rank's slice of each part (``Target.parts`` with the full row counts)."""
    wanted = set(suffixes)
    targets: dict[str, Target] = {}
    matched: set[str] = set()
    candidates: list[tuple[str, tuple[tuple[str, int], ...], bool]] = [
        (f"{_site_path(name)}.linear", shard.site.parts, True)
        for name, shard in model.shards.items()
    ]
    candidates += [(path, site.parts, False) for path, site in model.linear_sites().items()]
    for path, parts, sharded in candidates:
        leaves = [n.rsplit(".", 1)[-1] for n, _ in parts]
        hits = [leaf for leaf in leaves if leaf in wanted]
        if not hits:
            continue
        if len(hits) != len(leaves):
            missing = sorted(set(leaves) - wanted)
            raise GrpoConfigError(
                f"lora_targets: {', '.join(sorted(hits))} share one fused weight with "
                f"{', '.join(missing)} in this model ({path}); target them together or not at all",
                field="lora_targets",
            )
        if not sharded and model.groups.tp_size > 1:
            raise GrpoConfigError(
                f"lora_targets: {', '.join(hits)} ({path}) is a replicated linear; the megatron "
                "backend adapts only its tensor-parallel linears (q/k/v/o, gate/up/down) under "
                "tensor_model_parallel_size > 1",
                field="lora_targets",
            )
        targets[path] = Target(parts=parts) if len(parts) > 1 else Target(hf_name=parts[0][0])
        matched.update(hits)
    unmatched = sorted(wanted - matched)
    if unmatched:
        raise GrpoConfigError(
            f"lora_targets: {', '.join(unmatched)} match no linear of this model (routed "
            "experts are not LoRA targets in this build)",
            field="lora_targets",
        )
    return targets, sorted(matched)


def load_tensor_parallel_model(
    cfg: GrpoConfig, groups: ParallelGroups, *, device: torch.device
) -> TensorParallelDecoder:
    """The checkpoint at ``cfg.model_path`` as this rank's ``TensorParallelDecoder``."""
    if cfg.model_path is None:
        raise GrpoConfigError("model_path is required to train (--model-path)")
    model = TensorParallelDecoder(
        load_config(cfg.model_path, kv_capacity=cfg.context_length), groups,
        sequence_parallel=cfg.sequence_parallel, numerics=Numerics(cfg.numerics), device=device,
    )  # fmt: skip
    model.load_hf_state_dict(load_hf_tensors(cfg.model_path))
    return model.to(device)


def build_megatron_policy(
    cfg: GrpoConfig, backend: TrainerBackend, *, device: torch.device | None = None
) -> Policy:
    """Load, split and (optionally) adapt the policy on this rank; collective over the world.
    ``backend``: the policy's backend (``posttrain.grpo.megatron.backend.MEGATRON``)."""
    device = device or torch.device("cpu")
    groups = build_parallel_groups(cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size)
    model = load_tensor_parallel_model(cfg, groups, device=device)
    ref = None
    if cfg.use_kl_loss and cfg.train == "full":
        ref = load_tensor_parallel_model(cfg, groups, device=device).requires_grad_(False)
    mode: TrainMode = FullTraining(ref_model=ref)
    if cfg.train == "lora":
        targets, modules = megatron_lora_targets(model, cfg.lora_targets)
        # fp32 factors exported as fp32: the engine computes with the exact trainer bytes (G1).
        lcfg = LoraConfig(
            r=cfg.lora_r, alpha=cfg.lora_alpha, seed=cfg.seed, export_dtype=torch.float32
        )
        handle = attach_lora(model, lcfg, targets, LoraGroups(tp=groups.tp, dp=groups.dp))
        mode = AdapterTraining(handle=handle, config=lcfg, target_modules=modules)
    trainable = mode.trainable(model)
    optimizer: torch.optim.Optimizer
    if isinstance(mode, FullTraining) and needs_masters(trainable):  # fp32 masters of bf16/fp16
        optimizer = MasterAdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    world = dist.get_world_size()
    # A world-wide (1 x world) mesh: only the checkpoint commit protocol uses it (its barrier
    # group and meta.json); nothing is sharded by FSDP on this backend.
    mesh = build_fsdp_mesh(MeshSpec(world_size=world, replicate=1, device_type=device.type))
    parallel = DataContextParallel(
        cp_group=None, cp_size=1, dp_rank=groups.dp_rank, dp_size=groups.dp_size
    )
    return Policy(
        model=model, mesh=mesh, optimizer=optimizer, backend=backend, mode=mode,
        parallel=parallel,
    )  # fmt: skip
