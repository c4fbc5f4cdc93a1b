"""The ``fsdp`` trainer backend: the policy sharded with FSDP2 (HSDP), full or LoRA training.

``build_policy`` loads a ``posttrain.models`` decoder, shards it with ``fsdp-mesh``
(``apply_hsdp`` on the (replicate, shard) mesh, fp32 parameters and reductions) and, for
adapter training, attaches ``lora-core`` LoRA to the model's linear sites. The sites carry the
model's own kernel, so the trainer's LoRA forward is the engine's, op for op
(``posttrain.formats.lora_delta`` on ``StrictOps.linear``): in strict numerics the recomputed
logprob of every rollout token equals the engine's bit for bit, with or without an adapter.

Departures from the obvious:

* The LoRA factors are kept out of FSDP (``ignored_params``): plain replicated tensors whose
  gradients ``reduce_lora_grads`` averages over the data-parallel group and whose norm
  ``lora_grad_norm`` measures, so every rank holds the same adapter to export.
* FSDP units: one per decoder layer of at least ``fsdp_layer_min_params`` parameters (smaller
  layers stay in the root unit: one collective a phase beats one per layer), then the root.
  Each layer's compute runs through the layer module's ``__call__`` (``DecoderModel`` passes a
  ``LayerCall``), so FSDP2 gathers a layer's parameters just before it (prefetching the next
  layer's), reshards them after its forward and reduces its gradients as soon as its backward
  is done. Inputs are not cast: the residual stream stays fp32 between layers. ``forward_logits``
  is registered as an FSDP
  forward of the root. ``activation_checkpointing`` recomputes each layer in the backward.
  ``compile`` (fast numerics) then runs ``torch.compile`` on each layer's forward
  (``posttrain.models.compile_layers``, in ``compile_mode``): after sharding, so FSDP2's hooks
  stay eager. Fast
  numerics on CUDA step with ``AdamW(fused=True)`` (``fused_adamw``); every other case with
  ``foreach=True`` (one op per step over all parameters: on CPU, torch's default steps them one
  by one, each op dispatched through FSDP2's DTensor: 19 ms of the recipe's 0.2 s train step).
* A rank's loss is scaled by the world size W: FSDP (and ``reduce_lora_grads``) average
  gradients over W, and the normalisers (``global_batch_size``, ``global_token_count``) are
  the whole step's, so the averaged gradient is that of the global-batch loss.
* One optimizer step per rollout step. The "old" policy is the one that sampled: the trainer's
  own recompute of the rollout tokens (detached), so the PPO ratio starts at 1 and TIS compares
  the trainer with the engine.
* Context parallel (``context_parallel_size`` C > 1): the world is D data-parallel x C
  context-parallel ranks, CP groups of C consecutive ranks (explicit process groups). The
  ranks of one CP group get the same samples (``Policy.data_parallel_share``); each packed
  micro-batch (every sequence padded at its end to a multiple of 2C, pad tokens masked out) is
  run through ``posttrain.models.context_parallel.forward_context_parallel`` (zigzag), so a
  rank computes the loss terms of its own tokens only. The aggregation is applied as
  per-token weights computed over whole sequences (``aggregation_weights``), so the C ranks'
  losses add up to the sequence-level loss exactly; FSDP still averages gradients over all
  W = D x C ranks and each loss is still scaled by W, so the update is the CP=1 update.
  Entropy is taken on each rank's logits rows and moved to the token they predict with a
  one-token halo. LoRA works unchanged: lora-core's wrapped sites are per-token linears that
  ``forward_with_layout`` calls like ``forward_logits`` does.
* Multimodal samples (``TrainSample.media``, the references the engine got): ``batch.pack`` decodes
  them with ``posttrain.models.decode_media_refs``, expands each prompt's sentinels into their
  placeholder runs (``expand_media_tokens``, as the engine does) and packs one ``MediaBatch``;
  the response is scored against the expanded prompt, so the logprobs are the engine's. The
  towers are frozen: their parameters are left out of the optimizer (no state, grads None),
  and LoRA never targets them. Context parallel does not take media (refused).
* There are no separate fp32 master copies (parameters are the masters; with
  ``precision="bf16"`` FSDP2 keeps the fp32 shards and casts a compute copy), so a write into
  the parameters after the optimizer exists (a resume) is what the next step starts from (G8;
  trap 1 of issue 25, ``tests/test_grpo_resume_masters.py``, which also shows masters
  snapshotted before the load would be caught). Full training of a bf16 (or fp16) checkpoint
  upcasts the parameters to fp32 before sharding: they are the fp32 masters, FSDP's compute
  copy is in the checkpoint's dtype (what the engine serves, so strict parity holds), the
  weight sync converts with ``to_hf_state_dict`` (the checkpoint's dtype) and checkpoints keep
  the fp32 masters (``tests/test_grpo_masters.py``). LoRA factors are fp32 as before.
* The step itself is the shared one (``posttrain.grpo.step``) under this backend's
  ``StepRules``: FSDP's ``accumulate_gradients``, the loss scaled by W, FSDP-reduced
  gradients (lora-core's reduction for the factors), chunked logprobs in fast numerics.
  ``--backend megatron`` (``posttrain.grpo.megatron.backend``) is the other ``TrainerBackend``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import register_fsdp_forward_method

from posttrain.formats import check_finite
from posttrain.fsdp_mesh import (
    CheckpointMeta,
    HsdpConfig,
    accumulate_gradients,
    apply_hsdp,
    build_fsdp_mesh,
    grad_norm,
    iter_full_state_dict,
    load_checkpoint,
    save_checkpoint,
    save_files_checkpoint,
)
from posttrain.grpo._errors import GrpoConfigError, GrpoRunError
from posttrain.grpo._state_files import load_optimizer, save_optimizer, save_rng
from posttrain.grpo.backend import (
    AdapterTraining,
    FullTraining,
    Policy,
    StepRules,
    TrainMode,
    data_context_parallel,
)
from posttrain.grpo.checkpoint import OPTIM, restore_rng, rng_file
from posttrain.grpo.config import Backend, GrpoConfig
from posttrain.interface import MeshSpec
from posttrain.lora import LoraConfig, LoraGroups, Target, attach_lora
from posttrain.models import (
    DecoderModel,
    LinearSite,
    ModelConfig,
    Numerics,
    compile_layers,
    load_pretrained,
    to_hf_state_dict,
)


def lora_targets(
    model: DecoderModel, suffixes: Sequence[str]
) -> tuple[dict[str, Target], list[str]]:
    """lora-core ``Target``s for the linear sites whose PEFT modules end with ``suffixes``.

    A fused site (``qkv``: q_proj, k_proj, v_proj) is adapted as one (one A, B over its rows),
    so its parts are targeted all together or not at all. Returns the targets and the PEFT
    ``target_modules`` list for the adapter config.
    """
    wanted = tuple(suffixes)
    targets: dict[str, Target] = {}
    modules: set[str] = set()
    matched: set[str] = set()
    for path, site in model.linear_sites().items():
        names = [name for name, _ in site.parts]
        hits = [n for n in names if n.rsplit(".", 1)[-1] in wanted]
        if not hits:
            continue
        if len(hits) != len(names):
            missing = sorted({n.rsplit(".", 1)[-1] for n in names} - set(wanted))
            raise GrpoConfigError(
                f"lora_targets: {', '.join(sorted({h.rsplit('.', 1)[-1] for h in hits}))} share "
                f"one fused weight with {', '.join(missing)} in this model ({path}); target "
                "them together or not at all"
            )
        targets[path] = _target(site)
        matched.update(n.rsplit(".", 1)[-1] for n in names)
        modules.update(n.rsplit(".", 1)[-1] for n in names)
    unmatched = sorted(set(wanted) - matched)
    if unmatched:
        raise GrpoConfigError(
            f"lora_targets: {', '.join(unmatched)} match no linear of this model (routed "
            "experts are not LoRA targets in this build)"
        )
    return targets, sorted(modules)


def _target(site: LinearSite) -> Target:
    if len(site.parts) == 1:
        return Target(hf_name=site.parts[0][0])
    return Target(parts=site.parts)


_LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


def fused_adamw(model: DecoderModel, params: Sequence[torch.nn.Parameter]) -> bool | None:
    """``torch.optim.AdamW``'s ``fused``: True (one kernel for every parameter) in fast
    numerics when every parameter is a CUDA fp32 tensor (FSDP2's DTensor shards included), else
    None (the caller then asks for ``foreach``: the same update to fp32 rounding, deterministic
    run to run, so resumes stay bit for bit)."""
    fused = (
        model.numerics is Numerics.FAST
        and bool(params)
        and all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params)
    )
    return True if fused else None


def _unit_layers(
    model: DecoderModel, min_params: int, ignored: set[torch.nn.Parameter]
) -> set[int]:
    """The ids of the decoder layers that get their own FSDP unit: those with at least
    ``min_params`` sharded parameters (``ignored`` ones, the LoRA factors, do not count).

    A unit costs an all-gather in the forward, another in the backward and a reduce-scatter,
    each a collective whose latency does not shrink with the layer: on the embedded recipe's
    62k-parameter layers over gloo, per-layer units made the strict CPU train step 1.5x slower
    than one root unit (``docs/benchmarks/grpo.md``). Above the threshold the memory a unit
    frees and the overlap it allows pay for it, as in torch's size-based wrap policies."""
    return {
        id(layer)
        for layer in model.layers
        if sum(p.numel() for p in layer.parameters() if p not in ignored) >= min_params
    }


def shard_policy(
    model: DecoderModel,
    cfg: GrpoConfig,
    *,
    device: torch.device,
    ref_model: DecoderModel | None = None,
) -> Policy:
    """Shard ``model`` (already on ``device``) over the world, with LoRA factors on ``device``
    when ``cfg.train == "lora"``, and build its optimizer; collective over the world."""
    world = dist.get_world_size()
    parallel = data_context_parallel(cfg.context_parallel_size)
    mesh = build_fsdp_mesh(
        MeshSpec(
            world_size=world, replicate=cfg.replicate, shard=cfg.shard, device_type=device.type
        )
    )
    mode: TrainMode = FullTraining(ref_model=ref_model)
    ignored: set[torch.nn.Parameter] = set()
    if cfg.train == "lora":
        targets, modules = lora_targets(model, cfg.lora_targets)
        # fp32 factors exported as fp32: the engine computes with the exact trainer bytes (G1).
        lcfg = LoraConfig(
            r=cfg.lora_r, alpha=cfg.lora_alpha, seed=cfg.seed, export_dtype=torch.float32
        )
        # attach_lora creates each factor on its base weight's device, i.e. on ``device``.
        handle = attach_lora(model, lcfg, targets, LoraGroups(dp=dist.group.WORLD))
        mode = AdapterTraining(handle=handle, config=lcfg, target_modules=modules)
        ignored = set(handle.parameters())
    param_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    if cfg.train == "full" and model.config.dtype in _LOW_PRECISION_DTYPES:
        # fp32 masters for a bf16/fp16 checkpoint: the optimizer updates fp32 parameters (an
        # update below the checkpoint dtype's resolution still accumulates), FSDP casts the
        # compute copy back to the checkpoint dtype (the engine's weights: strict parity holds),
        # checkpoints hold the fp32 masters, and ``to_hf_state_dict`` gives the config's dtype.
        param_dtype = model.config.dtype
        model.float()
    # One FSDP unit per decoder layer of at least ``fsdp_layer_min_params`` parameters (each
    # layer's compute runs through its module's ``__call__``), then the root (embedding, final
    # norm, head, towers, smaller layers). Layers get the fp32 residual stream as it is (no
    # input cast): only their parameters take ``param_dtype``.
    layers = _unit_layers(model, cfg.fsdp_layer_min_params, ignored)
    model.activation_checkpointing = cfg.activation_checkpointing
    if cfg.precision == "bf16" and model.numerics is Numerics.FAST and not model.config.is_mla:
        # bf16 compute that is bf16: FSDP's bf16 compute copy feeds bf16 matmuls and attention
        # (norms, residual stream, logits and log-softmax stay fp32); masters stay fp32.
        model.compute_dtype = torch.bfloat16
    apply_hsdp(
        model,
        mesh,
        HsdpConfig(
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            cast_forward_inputs=False,
            forward_prefetch=True,
            # the root alone (no layer big enough for a unit): keep its gathered parameters for
            # the backward instead of gathering them again (small layers, by that choice)
            reshard_after_forward=bool(layers),
        ),
        wrap=lambda module: id(module) in layers,
        ignored_params=ignored,
    )
    register_fsdp_forward_method(model, "forward_logits")
    register_fsdp_forward_method(model, "forward_token_logprobs")
    # forward_logits may return a view; nothing here writes into it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # Frozen parameters (the media towers) get no optimizer state: only what trains is in it.
    trainable = mode.trainable(model)
    if cfg.compile:
        # after sharding: FSDP2's hooks stay outside the compiled forwards
        compile_layers(model, mode=cfg.compile_mode)
    fused = fused_adamw(model, trainable)
    optimizer = torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=fused,
        foreach=True if fused is None else None,
    )
    return Policy(
        model=model, mesh=mesh, optimizer=optimizer, backend=FSDP, mode=mode, parallel=parallel
    )


class FsdpBackend:
    """The ``fsdp`` ``TrainerBackend``: HSDP over (replicate, shard), context parallel."""

    @property
    def name(self) -> Backend:
        return "fsdp"

    def preload(self) -> None:
        """Nothing beyond torch, which the parent has imported."""

    def check_model(self, cfg: GrpoConfig, model: ModelConfig, location: str) -> None:
        """Every family ``posttrain.models`` loads trains on this backend."""

    def describe_ranks(self, cfg: GrpoConfig, world: int) -> str:
        return (
            f"trainer ranks: {cfg.world_size} (replicate x shard) = {cfg.data_parallel_size} "
            f"data parallel x {cfg.context_parallel_size} context parallel"
        )

    def build_policy(self, cfg: GrpoConfig) -> Policy:
        if cfg.model_path is None:
            raise GrpoConfigError("model_path is required to train (--model-path)")
        numerics, capacity = Numerics(cfg.numerics), cfg.context_length
        model = load_pretrained(cfg.model_path, numerics=numerics, kv_capacity=capacity)
        ref = None
        if cfg.use_kl_loss and cfg.train == "full":
            ref = load_pretrained(cfg.model_path, numerics=numerics, kv_capacity=capacity)
            ref.requires_grad_(False)
        return shard_policy(model, cfg, device=torch.device("cpu"), ref_model=ref)

    def step_rules(self, policy: Policy) -> StepRules:
        """FSDP accumulates (one replicate all-reduce per step) and averages over all W ranks;
        fast numerics take the logprobs chunk by chunk."""
        model, mode = policy.model, policy.mode

        def reduce() -> float:  # FSDP has reduced the full gradients in the backward
            return (
                mode.reduce_gradients() if isinstance(mode, AdapterTraining) else grad_norm(model)
            )

        return StepRules(
            accumulation=lambda n: accumulate_gradients(model, n),
            loss_scale=dist.get_world_size(),
            reduce_gradients=reduce,
            chunked_logprobs=model.numerics is Numerics.FAST,
        )

    def export_weights(self, policy: Policy) -> dict[str, Tensor]:
        if isinstance(policy.mode, AdapterTraining):
            return policy.mode.export()
        full = dict(iter_full_state_dict(policy.model))  # collective over the FSDP mesh
        # Only rank 0 sends, so only rank 0 converts.
        return to_hf_state_dict(full, policy.model.config) if dist.get_rank() == 0 else {}

    def save_checkpoint(self, root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
        """Full training: DCP shards of model + optimizer (every rank); adapter training: the
        PEFT adapter and the (replicated) optimizer state from rank 0. Every rank's RNG."""
        rank = dist.get_rank()

        def write_rng(staged: Path) -> None:
            save_rng(rng_file(staged, rank))

        mode = policy.mode
        if not isinstance(mode, AdapterTraining):
            return save_checkpoint(
                root, step, policy.model, policy.mesh, policy.optimizer,
                extra=extra, write_files=write_rng,
            )  # fmt: skip
        adapter = mode.export()  # collective; the same full adapter on every rank

        def write_adapter(staged: Path) -> None:
            write_rng(staged)
            if rank == 0:  # the adapter and its optimizer state are replicated
                mode.save(staged / "adapter", adapter)
                save_optimizer(staged / OPTIM, policy.optimizer)

        return save_files_checkpoint(root, step, policy.mesh, write_adapter, extra=extra)

    def load_checkpoint(self, path: Path, policy: Policy, meta: CheckpointMeta) -> None:
        if isinstance(policy.mode, AdapterTraining):
            policy.mode.load(path / "adapter")
            load_optimizer(path / OPTIM, policy.optimizer)
        else:
            load_checkpoint(
                path.parent, policy.model, policy.mesh, policy.optimizer, step=meta.step
            )
            _check_loaded(path, policy)
        restore_rng(path, meta)


def _check_loaded(path: Path, policy: Policy) -> None:
    """The weights a DCP load put into the live (sharded) parameters: finite and bounded, on
    every rank's shard; every rank raises (one rank's refusal never leaves others waiting)."""
    params = (
        (name, getattr(p, "_local_tensor", p).detach())
        for name, p in policy.model.named_parameters()
    )
    mine = ""
    try:
        check_finite(params, what=f"--resume {path}", error=GrpoRunError)
    except GrpoRunError as exc:
        mine = str(exc)
    every: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    refused = [m for m in every if m]
    if refused:
        raise GrpoRunError(refused[0])


FSDP = FsdpBackend()
