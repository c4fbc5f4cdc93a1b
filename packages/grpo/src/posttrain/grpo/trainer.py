"""The policy on the trainer ranks: build it, and take one GRPO step on a rank's samples.

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
* FSDP units: one per decoder layer, then the root. Each layer's compute runs through the
  layer module's ``__call__`` (``DecoderModel`` passes a ``LayerCall``), so FSDP2 gathers a
  layer's parameters just before it (prefetching the next layer's), reshards them after its
  forward and reduces its gradients as soon as its backward is done. Inputs are not cast: the
  residual stream stays fp32 between layers. ``forward_logits`` is registered as an FSDP
  forward of the root. ``activation_checkpointing`` recomputes each layer in the backward.
  ``compile`` (fast numerics) then runs ``torch.compile`` on each layer's forward
  (``posttrain.models.compile_layers``): after sharding, so FSDP2's hooks stay eager. Fast
  numerics on CUDA step with ``AdamW(fused=True)`` (``fused_adamw``); strict keeps the default.
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
* Multimodal samples (``TrainSample.media``, the references the engine got): ``_pack`` decodes
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
* ``--backend megatron`` (``posttrain.grpo.megatron``) builds a ``TensorParallelDecoder``
  instead (tensor / sequence / expert parallel on megatron-core's parallel linears); the step is
  the same code (``compute_gradients``), with no FSDP: gradients add up over micro-batches and
  are reduced once (``megatron.grads`` or lora-core), each loss is scaled by the data-parallel
  size (the TP ranks of one group share their samples and report metrics once).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import register_fsdp_forward_method

from posttrain.fsdp_mesh import (
    FsdpMesh,
    HsdpConfig,
    accumulate_gradients,
    apply_hsdp,
    build_fsdp_mesh,
    grad_norm,
    scale_grads_to_norm,
)
from posttrain.grpo._errors import GrpoConfigError, GrpoInputError, GrpoUnsupportedError
from posttrain.grpo.config import Backend, GrpoConfig
from posttrain.grpo.losses import aggregation_weights, entropy_from_logits
from posttrain.grpo.objective import LossSettings, PolicyObjective, policy_objective
from posttrain.interface import MediaRef, MeshSpec
from posttrain.lora import (
    LoraConfig,
    LoraGroups,
    LoraHandle,
    Target,
    attach_lora,
    lora_grad_norm,
    reduce_lora_grads,
)
from posttrain.models import (
    DecoderModel,
    LinearSite,
    MediaBatch,
    Numerics,
    compile_layers,
    decode_media_refs,
    expand_media_tokens,
    load_pretrained,
)
from posttrain.models import context_parallel as cp

CP_LAYOUT = cp.CPLayout.ZIGZAG  # load-balanced: rank r holds chunks r and 2C-1-r of a sequence

# Step metrics that are already normalised by the whole step (sum over ranks), and those
# that are maxima; every other metric is a per-token mean (weighted by each rank's tokens).
SUM_METRICS = frozenset({"loss", "pg_loss", "ppo_kl", "kl_loss", "entropy"})
MAX_METRICS = frozenset({"train_rollout_logprob_max_abs_diff"})


@dataclass(kw_only=True, slots=True)
class TrainSample:
    """One sample as the trainer needs it (prompt + response ids, per-response-token arrays).

    ``tokens`` hold the prompt as the engine got it (one sentinel per media item); ``media``
    are the references of those items (``Sample.media``), expanded when the batch is packed.
    """

    tokens: list[int]
    prompt_len: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    advantages: list[float]
    media: list[MediaRef] = field(default_factory=list)

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True, slots=True, kw_only=True)
class DataContextParallel:
    """This rank's place in the data-parallel x context-parallel split of the world."""

    cp_group: dist.ProcessGroup | None
    cp_size: int
    dp_rank: int
    dp_size: int


def data_context_parallel(cp_size: int) -> DataContextParallel:
    """Split the world into ``world / cp_size`` CP groups of consecutive ranks; collective.

    Every rank creates every group (``dist.new_group`` is collective over the world) and keeps
    its own. ``cp_size == 1`` creates none: each rank is its own data-parallel rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise GrpoConfigError(
            f"context_parallel_size must be an int >= 1, got {cp_size!r}",
            field="context_parallel_size",
        )
    if world % cp_size:
        raise GrpoConfigError(
            f"context_parallel_size={cp_size} does not divide the world size {world}",
            field="context_parallel_size",
        )
    if cp_size == 1:
        return DataContextParallel(cp_group=None, cp_size=1, dp_rank=rank, dp_size=world)
    mine: dist.ProcessGroup | None = None
    for start in range(0, world, cp_size):
        group = dist.new_group(list(range(start, start + cp_size)))
        if start <= rank < start + cp_size:
            mine = group
    return DataContextParallel(
        cp_group=mine, cp_size=cp_size, dp_rank=rank // cp_size, dp_size=world // cp_size
    )


@dataclass(kw_only=True, slots=True)
class Policy:
    """The sharded model, its optimizer and (adapter training) the LoRA handle."""

    model: DecoderModel
    mesh: FsdpMesh
    optimizer: torch.optim.Optimizer
    lora: LoraHandle | None = None
    lora_config: LoraConfig | None = None
    target_modules: list[str] = field(default_factory=list)
    ref_model: DecoderModel | None = None
    parallel: DataContextParallel | None = None
    backend: Backend = "fsdp"

    @property
    def cp_size(self) -> int:
        return 1 if self.parallel is None else self.parallel.cp_size

    def data_parallel_share(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """This rank's samples of a step: a strided split over the data-parallel ranks only
        (every rank of one context-parallel group gets the same samples)."""
        if self.parallel is None:
            return list(samples[dist.get_rank() :: dist.get_world_size()])
        return list(samples[self.parallel.dp_rank :: self.parallel.dp_size])

    def trainable(self) -> list[torch.nn.Parameter]:
        if self.lora is not None:
            return list(self.lora.parameters())
        return [p for p in self.model.parameters() if p.requires_grad]


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


def build_policy(cfg: GrpoConfig) -> Policy:
    """Load, shard and (optionally) adapt the policy on this rank (CPU); collective.

    ``cfg.backend == "megatron"``: ``posttrain.grpo.megatron.build_megatron_policy``.
    """
    if cfg.backend == "megatron":
        if importlib.util.find_spec("megatron") is None:
            raise GrpoUnsupportedError(
                "backend",
                "--backend megatron needs megatron-core, which is not installed: "
                "pip install 'posttrain-grpo[megatron]' (Linux)",
            )
        from posttrain.grpo.megatron.policy import build_megatron_policy

        return build_megatron_policy(cfg)
    if cfg.model_path is None:
        raise GrpoConfigError("model_path is required to train (--model-path)")
    numerics, capacity = Numerics(cfg.numerics), cfg.context_length
    model = load_pretrained(cfg.model_path, numerics=numerics, kv_capacity=capacity)
    ref = None
    if cfg.use_kl_loss and cfg.train == "full":
        ref = load_pretrained(cfg.model_path, numerics=numerics, kv_capacity=capacity)
        ref.requires_grad_(False)
    return shard_policy(model, cfg, device=torch.device("cpu"), ref_model=ref)


_LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


def fused_adamw(model: DecoderModel, params: Sequence[torch.nn.Parameter]) -> bool | None:
    """``torch.optim.AdamW``'s ``fused``: True (one kernel for every parameter) in fast
    numerics when every parameter is a CUDA fp32 tensor (FSDP2's DTensor shards included), else
    None, torch's default (``foreach`` on CUDA). Strict numerics keep the default path, whose
    update the parity and resume tests pin."""
    fused = (
        model.numerics is Numerics.FAST
        and bool(params)
        and all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params)
    )
    return True if fused else None


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
    handle: LoraHandle | None = None
    lcfg: LoraConfig | None = None
    modules: list[str] = []
    ignored: set[torch.nn.Parameter] = set()
    if cfg.train == "lora":
        targets, modules = lora_targets(model, cfg.lora_targets)
        # fp32 factors exported as fp32: the engine computes with the exact trainer bytes (G1).
        lcfg = LoraConfig(
            r=cfg.lora_r, alpha=cfg.lora_alpha, seed=cfg.seed, export_dtype=torch.float32
        )
        # attach_lora creates each factor on its base weight's device, i.e. on ``device``.
        handle = attach_lora(model, lcfg, targets, LoraGroups(dp=dist.group.WORLD))
        ignored = set(handle.parameters())
    param_dtype = torch.bfloat16 if cfg.precision == "bf16" else None
    if cfg.train == "full" and model.config.dtype in _LOW_PRECISION_DTYPES:
        # fp32 masters for a bf16/fp16 checkpoint: the optimizer updates fp32 parameters (an
        # update below the checkpoint dtype's resolution still accumulates), FSDP casts the
        # compute copy back to the checkpoint dtype (the engine's weights: strict parity holds),
        # checkpoints hold the fp32 masters, and ``to_hf_state_dict`` gives the config's dtype.
        param_dtype = model.config.dtype
        model.float()
    # One FSDP unit per decoder layer (each layer's compute runs through its module's
    # ``__call__``), then the root (embedding, final norm, head, towers). Layers get the fp32
    # residual stream as it is (no input cast): only their parameters take ``param_dtype``.
    layers = {id(layer) for layer in model.layers}
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
        ),
        wrap=lambda module: id(module) in layers,
        ignored_params=ignored,
    )
    register_fsdp_forward_method(model, "forward_logits")
    register_fsdp_forward_method(model, "forward_token_logprobs")
    # forward_logits may return a view; nothing here writes into it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # Frozen parameters (the media towers) get no optimizer state: only what trains is in it.
    trainable = (
        list(handle.parameters())
        if handle is not None
        else [p for p in model.parameters() if p.requires_grad]
    )
    if cfg.compile:
        compile_layers(model)  # after sharding: FSDP2's hooks stay outside the compiled forwards
    optimizer = torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        fused=fused_adamw(model, trainable),
    )
    return Policy(
        model=model,
        mesh=mesh,
        optimizer=optimizer,
        lora=handle,
        lora_config=lcfg,
        target_modules=modules,
        ref_model=ref_model,
        parallel=parallel,
    )


def expand_sample_media(
    sample: TrainSample, model: DecoderModel
) -> tuple[list[int], int, MediaBatch | None]:
    """The sample's tokens with every media sentinel expanded into its placeholder run, the
    expanded prompt length and the runs (None for a text-only sample)."""
    if not sample.media:
        return list(sample.tokens), sample.prompt_len, None
    media = decode_media_refs(model.config, sample.media)
    prompt, batch = expand_media_tokens(sample.tokens[: sample.prompt_len], media, model.config)
    return prompt + list(sample.tokens[sample.prompt_len :]), len(prompt), batch


def _pack(
    samples: Sequence[TrainSample], device: torch.device, model: DecoderModel
) -> dict[str, Any]:
    expanded = [expand_sample_media(s, model) for s in samples]
    ids = torch.tensor([t for toks, _, _ in expanded for t in toks], dtype=torch.long)
    lengths = [len(toks) for toks, _, _ in expanded]
    rows: list[int] = []  # logits row predicting each response token
    start = 0
    for toks, prompt_len, _ in expanded:
        rows.extend(range(start + prompt_len - 1, start + len(toks) - 1))
        start += len(toks)
    media = None
    if any(b is not None for _, _, b in expanded):
        media = MediaBatch.pack([b for _, _, b in expanded], lengths)
    targets = torch.tensor([t for s in samples for t in s.tokens[s.prompt_len :]], dtype=torch.long)
    return {
        "ids": ids.to(device),
        "lengths": lengths,
        "rows": torch.tensor(rows, dtype=torch.long, device=device),
        "targets": targets.to(device),
        "mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool).to(
            device
        ),
        "rollout": torch.tensor([v for s in samples for v in s.rollout_logprobs]).to(device),
        "advantages": torch.tensor([v for s in samples for v in s.advantages]).to(device),
        "response_lengths": [s.response_len for s in samples],
        "media": media,
    }


def _response_logprobs(
    model: DecoderModel, batch: dict[str, Any], *, with_logits: bool
) -> tuple[Tensor, Tensor | None]:
    """Logprob of each response token (and the logits predicting it), as the engine computes."""
    logits = model.forward_logits(batch["ids"], batch["lengths"], media=batch["media"])
    picked = logits[batch["rows"]]
    logp = model.ops.log_softmax(picked).gather(1, batch["targets"][:, None])[:, 0]
    return logp, (picked if with_logits else None)


def _reference_logprobs(policy: Policy, batch: dict[str, Any]) -> Tensor:
    with torch.no_grad():
        if policy.lora is not None:
            policy.lora.set_enabled(False)
            try:
                return _response_logprobs(policy.model, batch, with_logits=False)[0]
            finally:
                policy.lora.set_enabled(True)
        assert policy.ref_model is not None
        return _response_logprobs(policy.ref_model, batch, with_logits=False)[0]


def _entropy(logits: Tensor, settings: LossSettings) -> Tensor:
    """Per-row entropy; always reported, it joins the graph only when the loss uses it."""
    if settings.entropy_coef != 0.0:
        return entropy_from_logits(logits)
    with torch.no_grad():
        return entropy_from_logits(logits.detach())


def _micro_batch_objective(
    policy: Policy,
    part: Sequence[TrainSample],
    cfg: GrpoConfig,
    settings: LossSettings,
    *,
    global_batch_size: int,
    global_token_count: int,
) -> tuple[PolicyObjective, int]:
    """The objective of one micro-batch on this rank (no context parallel), its loss tokens."""
    batch = _pack(part, policy.model.embedding.device, policy.model)
    model = policy.model
    if policy.backend == "fsdp" and model.numerics is Numerics.FAST:
        # logprobs and entropies chunk by chunk from the hidden states: no [T, vocab] logits
        logp, entropy = model.forward_token_logprobs(
            batch["ids"], batch["lengths"], batch["rows"], batch["targets"], media=batch["media"]
        )
        if settings.entropy_coef == 0.0:
            entropy = entropy.detach()
    else:
        logp, logits = _response_logprobs(model, batch, with_logits=True)
        assert logits is not None
        entropy = _entropy(logits, settings)
    ref = _reference_logprobs(policy, batch) if cfg.use_kl_loss else None
    objective = policy_objective(
        logp=logp,
        old_logp=logp.detach(),
        advantages=batch["advantages"],
        mask=batch["mask"],
        lengths=batch["response_lengths"],
        settings=settings,
        rollout_logp=batch["rollout"],
        ref_logp=ref,
        entropy=entropy,
        global_batch_size=global_batch_size,
        global_token_count=global_token_count,
    )
    return objective, int(batch["mask"].sum())


def _pack_context_parallel(
    samples: Sequence[TrainSample],
    cp_size: int,
    settings: LossSettings,
    *,
    capacity: int,
    global_batch_size: int,
    global_token_count: int,
) -> dict[str, Any]:
    """The whole packed micro-batch, per token of the stream, every sequence padded at its end
    to the layout's multiple (pad and prompt tokens are masked out; causal attention and
    convolutions never let a pad token change an earlier one). Values sit on the token they
    score: the model's logprob convention (``out[t] = log p(ids[t] | ids[:t])``)."""
    lengths = [len(s.tokens) for s in samples]
    padded = cp.padded_segment_lengths(lengths, cp_size, CP_LAYOUT)
    for i, (n, p) in enumerate(zip(lengths, padded, strict=True)):
        if p > capacity:
            raise GrpoInputError(
                f"sample {i} of the micro-batch has {n} tokens; context parallel pads it to {p} "
                f"(a multiple of 2 x context_parallel_size={cp_size}), more than the model's "
                f"KV capacity {capacity} (--context-length)"
            )
    ids: list[int] = []
    mask: list[int] = []
    rollout: list[float] = []
    advantages: list[float] = []
    for s, n in zip(samples, padded, strict=True):
        pad = n - len(s.tokens)
        ids += [*s.tokens, *[s.tokens[-1]] * pad]
        mask += [0] * s.prompt_len + [int(m != 0) for m in s.loss_mask] + [0] * pad
        rollout += [0.0] * s.prompt_len + list(s.rollout_logprobs) + [0.0] * pad
        advantages += [0.0] * s.prompt_len + list(s.advantages) + [0.0] * pad
    full_mask = torch.tensor(mask, dtype=torch.bool)
    weights = aggregation_weights(
        full_mask, padded, mode=settings.aggregation,
        global_batch_size=global_batch_size, global_token_count=global_token_count,
    )  # fmt: skip
    return {
        "ids": torch.tensor(ids, dtype=torch.long),
        "lengths": padded,
        "mask": full_mask,
        "rollout": torch.tensor(rollout, dtype=torch.float32),
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "weights": weights,
    }


def _next_token_entropy(out: cp.ContextParallelOutput, settings: LossSettings) -> Tensor:
    """Entropy of the distribution each local token was drawn from: row t-1's, which a
    one-token halo brings over when another rank holds it (0 at a sequence's first token)."""
    rows = _entropy(out.logits, settings)[:, None]
    plan = cp.plan_halo(out.shard, 2)
    return cp.halo_windows(rows, cp.exchange_halo(rows, plan, name="entropy"), plan)[0, :, 0]


def _context_parallel_objective(
    policy: Policy,
    part: Sequence[TrainSample],
    cfg: GrpoConfig,
    settings: LossSettings,
    *,
    global_batch_size: int,
    global_token_count: int,
) -> tuple[PolicyObjective, int]:
    """This rank's share of one micro-batch's objective under context parallel (the shares
    of the CP group add up to the micro-batch's objective), and its own loss tokens."""
    assert policy.parallel is not None
    if any(s.media for s in part):
        raise GrpoInputError(
            "context_parallel_size > 1 does not take multimodal samples (media placeholder "
            "runs would be split over ranks); train them with context_parallel_size=1"
        )
    group = policy.parallel.cp_group
    batch = _pack_context_parallel(
        part, policy.cp_size, settings,
        capacity=policy.model.config.capacity,
        global_batch_size=global_batch_size, global_token_count=global_token_count,
    )  # fmt: skip
    out = cp.forward_context_parallel(
        policy.model, batch["ids"], batch["lengths"], group, CP_LAYOUT
    )
    device = out.logprobs.device
    local = {k: out.shard.split(batch[k], name=k).to(device)
             for k in ("mask", "rollout", "advantages", "weights")}  # fmt: skip
    ref = None
    if cfg.use_kl_loss:
        ref = _reference_logprobs_cp(policy, batch["ids"], batch["lengths"], group)
    objective = policy_objective(
        logp=out.logprobs,
        old_logp=out.logprobs.detach(),
        advantages=local["advantages"],
        mask=local["mask"],
        lengths=[out.logprobs.shape[0]],
        settings=settings,
        rollout_logp=local["rollout"],
        ref_logp=ref,
        entropy=_next_token_entropy(out, settings),
        token_weights=local["weights"],
    )
    return objective, int(local["mask"].sum())


def _reference_logprobs_cp(
    policy: Policy, ids: Tensor, lengths: Sequence[int], group: dist.ProcessGroup | None
) -> Tensor:
    with torch.no_grad():
        if policy.lora is not None:
            policy.lora.set_enabled(False)
            try:
                return cp.forward_context_parallel(
                    policy.model, ids, lengths, group, CP_LAYOUT
                ).logprobs
            finally:
                policy.lora.set_enabled(True)
        assert policy.ref_model is not None
        return cp.forward_context_parallel(
            policy.ref_model, ids, lengths, group, CP_LAYOUT
        ).logprobs


def micro_batches(samples: Sequence[TrainSample], size: int) -> list[list[TrainSample]]:
    """Consecutive micro-batches of at most ``size`` samples (0: one micro-batch)."""
    if size <= 0 or size >= len(samples):
        return [list(samples)]
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


class _NoAccumulation:
    """The megatron backend's stand-in for FSDP's ``accumulate_gradients``: gradients simply
    add up over micro-batches (they are reduced once, after the last one)."""

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        yield


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
    ``grad_norm``, the global norm of those gradients.
    """
    world = dist.get_world_size()
    settings = LossSettings.from_config(cfg)
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
    megatron = policy.backend == "megatron"
    # The gradient is averaged over the ranks that hold different samples: all W under FSDP,
    # the data-parallel ranks under megatron (the TP ranks of one group share their samples).
    loss_scale = policy.parallel.dp_size if megatron and policy.parallel else world
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    tokens = 0
    acc_context = (
        contextlib.nullcontext(_NoAccumulation())
        if megatron
        else accumulate_gradients(model, n_micro)
    )
    with acc_context as acc:
        for part in parts:
            with acc.micro_batch():
                if not part:  # a rank without samples still joins the collectives
                    (
                        model.forward_logits(torch.tensor([0], device=device), [1]).sum() * 0.0
                    ).backward()  # type: ignore[no-untyped-call]
                    continue
                objective, count = objective_of(
                    policy, part, cfg, settings,
                    global_batch_size=global_batch_size, global_token_count=global_token_count,
                )  # fmt: skip
                (objective.loss * loss_scale).backward()  # type: ignore[no-untyped-call]
                tokens += count
                for key, value in objective.metrics.items():
                    if key in MAX_METRICS:
                        maxima[key] = max(maxima.get(key, 0.0), value)
                    elif key in SUM_METRICS:
                        sums[key] = sums.get(key, 0.0) + value
                    else:
                        sums[key] = sums.get(key, 0.0) + value * count
    norm = _reduce_gradients(policy)
    if megatron and _tensor_parallel_rank(model) != 0:
        sums, maxima, tokens = {}, {}, 0  # the TP group's rank 0 reports its samples
    metrics = _combine(sums, maxima, tokens)
    metrics["grad_norm"] = norm
    return metrics


def _tensor_parallel_rank(model: DecoderModel) -> int:
    groups = getattr(model, "groups", None)  # a megatron TensorParallelDecoder's
    return 0 if groups is None else int(groups.tp_rank)


def _reduce_gradients(policy: Policy) -> float:
    """Reduce the trainable gradients over the ranks; returns their global norm."""
    if policy.lora is not None:
        reduce_lora_grads(policy.lora)
        return lora_grad_norm(policy.lora)
    if policy.backend == "megatron":
        from posttrain.grpo.megatron import grads as megatron_grads
        from posttrain.grpo.megatron.model import TensorParallelDecoder

        model = policy.model
        assert isinstance(model, TensorParallelDecoder)
        params = policy.trainable()
        megatron_grads.reduce_gradients(model, params)
        return megatron_grads.grad_norm(model, params)
    return grad_norm(policy.model)


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
