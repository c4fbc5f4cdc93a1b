"""``GrpoConfig``: every option of a GRPO run, typed and validated before anything starts.

One flat ``kw_only`` dataclass, not nested sections: the trainer command line
(``python -m posttrain.grpo``) maps one flag to one field, and a run's ``config.json`` reads
top to bottom. ``__post_init__`` checks each field on its own (type, range, finiteness) and
the few that constrain each other (``clip_high`` vs ``clip_low``, the TIS window, OPD's
teacher, the declared MoE layout); every error is a ``GrpoConfigError`` naming the field.

What this build cannot honour (pipeline parallelism, tensor, sequence or expert parallel on the
fsdp backend, context parallel on the megatron backend) is refused by ``check_supported``, kept apart from ``__post_init__`` so
that a config for a later build can still be written, read and compared.

Defaults follow miles where the design note gives them (ε_lo 0.2, TIS window [0, 2],
seq-mean-token-mean aggregation, k1 KL, std normalisation on); the rest are small-run
defaults a user overrides.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

from posttrain.grpo._errors import GrpoConfigError, GrpoUnsupportedError

Backend = Literal["fsdp", "megatron"]
TrainMode = Literal["lora", "full"]
Precision = Literal["fp32", "bf16"]
Numerics = Literal["strict", "fast"]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
TisMode = Literal["off", "tis", "icepop"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean"]
RolloutQuant = Literal["none", "nvfp4"]
WeightSyncBackend = Literal["gloo", "nccl"]
WeightSyncMode = Literal["distributed", "disk", "tensor"]
LoraSyncMode = Literal["tensors", "disk"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
"""``torch.compile``'s mode for ``compile`` (``posttrain.models.CompileMode``, the same values)."""

DEFAULT_LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_OUT_DIR = Path("runs/grpo")


@dataclass(kw_only=True, slots=True)
class GrpoConfig:
    """A GRPO run. ``HELP`` below holds one line per field (the trainer's ``--help``)."""

    # What to train and where rollouts come from.
    model_path: Path | None = None
    engine_model_path: Path | None = None
    rollout_url: str | None = None
    engine_urls: tuple[str, ...] = ()
    router_url: str | None = None
    readmit_lost_engines: bool = True
    api_key_file: Path | None = None
    task: str = "addition"
    # The user's data and reward (``data``, ``scoring``); --prompt-data replaces --task.
    prompt_data: Path | None = None
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = None
    apply_chat_template: bool = True
    system_prompt: str | None = None
    reward: tuple[str, ...] = ()
    eval_data: tuple[str, ...] = ()
    eval_every: int = 0
    eval_samples_per_prompt: int = 1
    backend: Backend = "fsdp"
    train: TrainMode = "lora"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    lora_name: str = "policy"
    # Parallelism: HSDP over replicate x shard ranks (world = replicate * shard).
    replicate: int = 1
    shard: int = 2
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Context parallel: each sample's tokens split over CP groups of consecutive ranks.
    context_parallel_size: int = 1
    # Declared model shape (Megatron-style flags): checked against the checkpoint.
    num_layers: int | None = None
    num_experts: int | None = None
    moe_layer_freq: tuple[int, ...] | None = None
    precision: Precision = "fp32"
    activation_checkpointing: bool = False
    fsdp_layer_min_params: int = 1_000_000
    compile: bool = False
    compile_mode: CompileMode = "default"
    numerics: Numerics = "strict"
    context_length: int | None = None
    # The schedule.
    steps: int = 20
    seed: int = 0
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    micro_batch_size: int = 0
    max_new_tokens: int = 32
    temperature: float = 1.0
    # The optimizer.
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # The policy loss (design note opd-scoring.md section 6).
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    use_kl_loss: bool = False
    kl_coef: float = 0.0
    kl_type: KlType = "k1"
    entropy_coef: float = 0.0
    tis: TisMode = "off"
    tis_clip_low: float = 0.0
    tis_clip_high: float = 2.0
    loss_aggregation: LossAggregation = "seq_mean_token_mean"
    std_normalize: bool = True
    # On-policy distillation.
    opd: bool = False
    teacher_url: str | None = None
    opd_kl_coef: float = 1.0
    opd_top_k: int = 0
    # Rollout weights, output, resumption.
    rollout_quant: RolloutQuant = "none"
    weight_sync: WeightSyncMode = "distributed"
    lora_sync: LoraSyncMode = "tensors"
    sync_dir: Path | None = None  # disk syncs: a directory the engines read too
    weight_sync_backend: WeightSyncBackend = "gloo"
    weight_sync_address: str = "127.0.0.1"
    offload_engines: bool = False
    # Off-policy: step s+1's rollouts run while step s trains (one step stale, TIS applied).
    off_policy_overlap: bool = False
    out_dir: Path = DEFAULT_OUT_DIR
    resume: Path | None = None
    checkpoint_every: int = 0
    rollout_timeout_s: float = 600.0
    turn_timeout_s: float = 120.0
    dry_run: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_literal(f.name, getattr(self, f.name))
        if isinstance(self.lora_targets, str):
            raise GrpoConfigError(
                f"lora_targets={self.lora_targets!r} must be a tuple of names, not one string",
                field="lora_targets",
            )
        self.lora_targets = tuple(self.lora_targets)
        self.engine_urls = tuple(self.engine_urls)
        for name in ("reward", "eval_data"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise GrpoConfigError(
                    f"{name}={value!r} must be a tuple of strings, not one string", field=name
                )
            setattr(self, name, tuple(str(v) for v in value))
        for name in (
            "model_path", "engine_model_path", "out_dir", "resume", "api_key_file", "prompt_data",
            "sync_dir",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, Path(value))
        if self.moe_layer_freq is not None:
            self.moe_layer_freq = tuple(self.moe_layer_freq)
        self._check_ranges()
        self._check_together()

    def api_key(self) -> str | None:
        """The bearer token: ``api_key_file``'s, else ``$POSTTRAIN_API_KEY``, else None
        (``posttrain.formats.resolve_api_key``); refused when unreadable or not one token."""
        from posttrain.formats import FormatsConfigError, resolve_api_key

        try:
            return resolve_api_key(self.api_key_file, flag="--api-key-file")
        except FormatsConfigError as exc:
            raise GrpoConfigError(str(exc), field="api_key_file") from None

    def _check_ranges(self) -> None:
        for name in (
            "lora_r", "replicate", "shard", "tensor_model_parallel_size",
            "expert_model_parallel_size", "pipeline_model_parallel_size",
            "context_parallel_size", "steps",
            "prompts_per_step", "samples_per_prompt", "max_new_tokens", "eval_samples_per_prompt",
        ):  # fmt: skip
            _check_int(name, getattr(self, name), minimum=1)
        for name in (f.name for f in fields(self) if f.type == "bool"):  # every bool field
            if not isinstance(getattr(self, name), bool):
                raise GrpoConfigError(
                    f"{name} must be a bool, got {getattr(self, name)!r}", field=name
                )
        for name in (
            "checkpoint_every", "opd_top_k", "seed", "micro_batch_size", "eval_every",
            "fsdp_layer_min_params",
        ):  # fmt: skip
            _check_int(name, getattr(self, name), minimum=0)
        for name in ("num_layers", "num_experts", "context_length"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name in (
            "lora_alpha", "temperature", "lr", "max_grad_norm", "rollout_timeout_s",
            "turn_timeout_s",
        ):  # fmt: skip
            _check_float(name, getattr(self, name), positive=True)
        for name in ("weight_decay", "kl_coef", "entropy_coef", "tis_clip_low", "opd_kl_coef"):
            _check_float(name, getattr(self, name), positive=False)
        _check_float("tis_clip_high", self.tis_clip_high, positive=True)
        _check_float("clip_low", self.clip_low, positive=False)
        if self.clip_low >= 1.0:
            raise GrpoConfigError(
                f"clip_low={self.clip_low} must be < 1 (ratio floor 1 - clip_low)", field="clip_low"
            )
        if self.clip_high is not None:
            _check_float("clip_high", self.clip_high, positive=False)
        if self.dual_clip is not None:
            _check_float("dual_clip", self.dual_clip, positive=True)
            if self.dual_clip <= 1.0:
                raise GrpoConfigError(f"dual_clip={self.dual_clip} must be > 1", field="dual_clip")
        for name in ("rollout_url", "teacher_url", "router_url"):
            url = getattr(self, name)
            if url is not None:
                check_http_url(name, url)
        for i, url in enumerate(self.engine_urls):
            check_http_url(f"engine_urls[{i}]", url)
        if not isinstance(self.lora_name, str) or not self.lora_name or "," in self.lora_name:
            raise GrpoConfigError(
                f"lora_name must be one non-empty adapter name, got {self.lora_name!r}",
                field="lora_name",
            )
        if not isinstance(self.task, str) or not self.task:
            raise GrpoConfigError(f"task must be a non-empty name, got {self.task!r}", field="task")
        for name in ("input_key", "label_key", "metadata_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GrpoConfigError(f"{name} must be a non-empty key, got {value!r}", field=name)
        if self.train == "lora" and not self.lora_targets:
            raise GrpoConfigError(
                "lora_targets is empty; LoRA training needs at least one target",
                field="lora_targets",
            )
        for target in self.lora_targets:
            if not isinstance(target, str) or not target.strip():
                raise GrpoConfigError(
                    f"lora_targets holds an empty or non-string entry {target!r}",
                    field="lora_targets",
                )
        freq = self.moe_layer_freq
        if freq is not None and (not freq or any(v not in (0, 1) for v in freq)):
            raise GrpoConfigError(
                f"moe_layer_freq={list(freq)} must be a non-empty list of 0/1",
                field="moe_layer_freq",
            )

    def _check_together(self) -> None:
        if self.world_size % self.context_parallel_size:
            raise GrpoConfigError(
                f"context_parallel_size={self.context_parallel_size} does not divide the "
                f"{self.world_size} trainer ranks (replicate={self.replicate} x "
                f"shard={self.shard}); the world is data parallel x context parallel",
                field="context_parallel_size",
            )
        if self.tis_clip_low >= self.tis_clip_high:
            raise GrpoConfigError(
                f"tis_clip_low={self.tis_clip_low} must be < tis_clip_high={self.tis_clip_high}",
                field="tis_clip_low",
            )
        if self.off_policy_overlap and self.tis == "off":
            raise GrpoConfigError(
                "off_policy_overlap trains on samples one weight version stale: it needs "
                "importance weighting against the engine's logprobs (--tis tis or --tis icepop)",
                field="off_policy_overlap",
            )
        if self.off_policy_overlap and self.offload_engines:
            raise GrpoConfigError(
                "off_policy_overlap rolls out while the trainer steps, when offload_engines "
                "has released the engines' memory; use one or the other",
                field="off_policy_overlap",
            )
        if self.compile and self.numerics != "fast":
            raise GrpoConfigError(
                "compile needs numerics='fast' (--numerics fast): strict kernels keep their "
                "bit-exact order and are never compiled",
                field="compile",
            )
        if self.compile_mode != "default" and not self.compile:
            raise GrpoConfigError(
                f"compile_mode={self.compile_mode!r} needs compile=True (--compile)",
                field="compile_mode",
            )
        if self.teacher_url is not None and not self.opd:
            raise GrpoConfigError(
                "teacher_url is set but opd is off; set opd=True (--opd)", field="teacher_url"
            )
        freq = self.moe_layer_freq
        if freq is not None and self.num_layers is not None and len(freq) != self.num_layers:
            raise GrpoConfigError(
                f"moe_layer_freq has {len(freq)} entries but num_layers={self.num_layers}",
                field="moe_layer_freq",
            )
        if freq is not None and any(freq) and self.num_experts is None:
            raise GrpoConfigError(
                "moe_layer_freq declares MoE layers but num_experts is not set",
                field="moe_layer_freq",
            )

    @property
    def world_size(self) -> int:
        """Trainer ranks the parallel sizes describe (HSDP replicate x shard)."""
        return self.replicate * self.shard

    @property
    def data_parallel_size(self) -> int:
        """Groups of ranks that see different samples (world / context_parallel_size)."""
        return self.world_size // self.context_parallel_size

    @property
    def lora_scaling(self) -> float:
        return self.lora_alpha / self.lora_r

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (paths as strings, tuples as lists), in field order."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def check_supported(self, *, world_size: int | None = None) -> None:
        """Refuse what this build cannot run, naming the option and what would run.

        ``world_size``: the trainer ranks actually started (torchrun's ``WORLD_SIZE``); it must
        equal ``replicate * shard``.
        """
        if self.pipeline_model_parallel_size > 1:
            raise GrpoUnsupportedError(
                "pipeline_model_parallel_size",
                f"pipeline parallelism (pipeline_model_parallel_size="
                f"{self.pipeline_model_parallel_size}) is out of scope of this build: neither the "
                "fsdp nor the megatron backend splits layers over pipeline stages; use 1 (and "
                "--tensor-model-parallel-size / --expert-model-parallel-size with --backend "
                "megatron to split a large model)",
            )
        _BACKEND_CHECKS[self.backend](self, world_size)

    def _check_fsdp(self, world_size: int | None) -> None:
        """The fsdp backend: HSDP (and context parallel) only; the world is replicate x shard."""
        for name, what in (
            ("tensor_model_parallel_size", "tensor parallel"),
            ("expert_model_parallel_size", "expert parallel"),
        ):
            value = getattr(self, name)
            if value > 1:
                raise GrpoUnsupportedError(
                    name,
                    f"{what} ({name}={value}) needs --backend megatron; the fsdp backend "
                    "shards with HSDP (--replicate/--shard): use 1",
                )
        if self.sequence_parallel:
            raise GrpoUnsupportedError(
                "sequence_parallel",
                "sequence parallel needs --backend megatron with --tensor-model-parallel-size "
                "> 1 (the fsdp backend splits sequences with --context-parallel-size)",
            )
        if world_size is not None and world_size != self.world_size:
            raise GrpoUnsupportedError(
                "replicate",
                f"replicate={self.replicate} x shard={self.shard} = {self.world_size} trainer "
                f"ranks, but {world_size} were started (WORLD_SIZE); make them equal",
            )

    def _check_megatron(self, world_size: int | None) -> None:
        """The megatron backend: tp and ep must divide the trainer ranks (torchrun's
        ``WORLD_SIZE``; when the trainer forks its own ranks, ``replicate * shard`` of them)."""
        if self.compile:
            raise GrpoUnsupportedError(
                "compile",
                "compile (torch.compile of each decoder layer) is built for the fsdp "
                "backend; --backend megatron runs eagerly: drop --compile",
            )
        if self.context_parallel_size > 1:
            raise GrpoUnsupportedError(
                "context_parallel_size",
                f"context parallel (context_parallel_size={self.context_parallel_size}) runs on "
                "the fsdp backend only; with --backend megatron split long sequences with "
                "--sequence-parallel under --tensor-model-parallel-size > 1",
            )
        world = self.world_size if world_size is None else world_size
        for name in ("tensor_model_parallel_size", "expert_model_parallel_size"):
            value = getattr(self, name)
            if world % value:
                raise GrpoUnsupportedError(
                    name,
                    f"{name}={value} does not divide the {world} trainer ranks"
                    + (" (WORLD_SIZE)" if world_size is not None else
                       f" (replicate={self.replicate} x shard={self.shard})"),
                )  # fmt: skip


# Each backend's checks of the config (``check_supported``), by ``GrpoConfig.backend``.
_BACKEND_CHECKS: dict[Backend, Callable[[GrpoConfig, int | None], None]] = {
    "fsdp": GrpoConfig._check_fsdp,
    "megatron": GrpoConfig._check_megatron,
}

HELP: dict[str, str] = {
    "model_path": "checkpoint directory (or hub id) of the policy",
    "engine_model_path": "checkpoint the engines serve, when not model_path (e.g. its NVFP4 "
    "conversion): an engine reloads its base from it after an offload cycle or when it is "
    "re-admitted during adapter training",
    "rollout_url": "session-router URL the rollouts go through",
    "api_key_file": "file holding the bearer token the session router and the engines' weight "
    "routes require (a file, so the key never shows in the process list); none: no token",
    "engine_urls": "engine URLs the trained weights are pushed to (each one directly)",
    "router_url": "sgl-router URL the engines are registered with: an engine a weight sync "
    "loses is deregistered there, and registered again once it holds the current weights",
    "readmit_lost_engines": "probe engines a weight sync lost at every later sync and bring "
    "back each that answers, after it took the current weights (off: a lost engine stays out "
    "of the syncs for good)",
    "task": "prompt set and reward (the embedded recipe's: addition)",
    "prompt_data": "prompt dataset (JSONL, JSON, parquet or a datasets save_to_disk directory); "
    "replaces --task's prompts",
    "input_key": "row key of the prompt (a text or a list of chat messages)",
    "label_key": "row key of the label the reward reads (none: no label)",
    "metadata_key": "row key of an object handed to the reward as metadata",
    "apply_chat_template": "render prompts with the model's chat template (off: raw text "
    "prompts, for base models without one)",
    "system_prompt": "system message before each prompt (raw text: a line before it)",
    "reward": "reward: math, exact, regex=PATTERN, length, module:function or "
    "path/file.py:function, each optionally :WEIGHT; repeat to sum (default: the task's)",
    "eval_data": "evaluation datasets (same format and keys as --prompt-data)",
    "eval_every": "evaluate --eval-data every N steps and after the last (0: after the last only)",
    "eval_samples_per_prompt": "samples per eval prompt: 1 is greedy, k > 1 sampled (pass@k)",
    "backend": "trainer backend: fsdp (HSDP) or megatron (tensor/sequence/expert parallel on "
    "megatron-core)",
    "train": "train a LoRA adapter or every parameter",
    "lora_r": "LoRA rank",
    "lora_alpha": "LoRA alpha (scaling = alpha / r)",
    "lora_targets": "module-name suffixes that get a LoRA adapter",
    "lora_name": "adapter name the engines serve (the session router's --lora-adapter)",
    "replicate": "HSDP replicate degree (data-parallel groups); with --backend megatron, "
    "replicate x shard is only the number of ranks to start when torchrun does not",
    "shard": "HSDP shard degree (ranks one parameter is sharded over)",
    "tensor_model_parallel_size": "tensor parallel size (--backend megatron): attention heads "
    "and the dense MLP split over this many consecutive ranks",
    "sequence_parallel": "with tensor parallel: keep each rank's share of the tokens between "
    "the parallel linears (--backend megatron)",
    "expert_model_parallel_size": "expert parallel size (--backend megatron): MoE experts "
    "split over this many consecutive ranks",
    "pipeline_model_parallel_size": "pipeline parallel size (only 1: out of scope of this build)",
    "context_parallel_size": "context parallel size: each sample's tokens are split over this "
    "many consecutive ranks (zigzag layout); must divide replicate x shard",
    "num_layers": "declared number of decoder layers",
    "num_experts": "declared number of routed experts (MoE)",
    "moe_layer_freq": "declared per-layer MoE pattern, 1 = MoE layer, e.g. [0]*1+[1]*46",
    "precision": "trainer activation precision",
    "activation_checkpointing": "recompute each decoder layer's activations in the backward "
    "(less memory, one more forward per layer; fsdp backend)",
    "fsdp_layer_min_params": "a decoder layer with at least this many parameters is its own "
    "FSDP unit (gathered just before it, resharded after, its gradients reduced as soon as its "
    "backward ends); smaller layers stay in the root unit, one all-gather and one "
    "reduce-scatter a step, where per-layer collectives would cost more than they overlap "
    "(fsdp backend; 0: every layer its own unit)",
    "compile": "torch.compile each decoder layer's forward (fast numerics, fsdp backend; "
    "falls back to eager with a warning where compiling fails)",
    "compile_mode": "torch.compile mode of --compile: default (the fastest measured), "
    "reduce-overhead (CUDA graphs; under FSDP2 they record again most steps, slower than eager "
    "on an H100), max-autotune, or max-autotune-no-cudagraphs",
    "numerics": "strict: engine-identical kernels; fast: stock torch ops",
    "context_length": "KV capacity: tokens per sample, prompt and output together (default: the "
    "model's max_position_embeddings); a launch passes the same to its engines",
    "steps": "GRPO steps",
    "seed": "seed of every random choice (data order, sampling, init)",
    "prompts_per_step": "prompts per step",
    "samples_per_prompt": "samples per prompt (the group size)",
    "micro_batch_size": "samples per micro-batch on a rank (0: one micro-batch)",
    "max_new_tokens": "most tokens a rollout sample generates",
    "temperature": "rollout sampling temperature",
    "lr": "AdamW learning rate",
    "weight_decay": "AdamW weight decay",
    "max_grad_norm": "clip the global gradient norm to this",
    "clip_low": "PPO clip epsilon below 1 (ratio >= 1 - clip_low)",
    "clip_high": "PPO clip epsilon above 1; default: clip_low",
    "dual_clip": "dual-clip constant c > 1 for negative advantages",
    "use_kl_loss": "add kl_coef * KL(policy || reference) to the loss",
    "kl_coef": "KL loss coefficient",
    "kl_type": "KL estimator",
    "entropy_coef": "entropy bonus coefficient (loss -= coef * H)",
    "tis": "train/rollout importance weighting",
    "tis_clip_low": "lower bound of the TIS/icepop window",
    "tis_clip_high": "upper bound of the TIS/icepop window",
    "loss_aggregation": "per-token loss reduction over the batch",
    "std_normalize": "divide group-centred rewards by the group std",
    "opd": "shape advantages with a teacher's reverse KL",
    "teacher_url": "teacher SGLang URL (OPD); default: a local teacher",
    "opd_kl_coef": "OPD coefficient: A = A - coef * reverse_kl",
    "opd_top_k": "OPD top-k (0: sampled tokens only)",
    "rollout_quant": "re-quantize synced weights for the engines",
    "weight_sync": "full weights: distributed (SGLang's update group; no shared disk), disk "
    "(a checkpoint in --sync-dir, /update_weights_from_disk) or tensor (colocated engines on "
    "the trainer's GPUs: CUDA IPC handles, /update_weights_from_tensor)",
    "lora_sync": "the adapter: tensors (in the request; no shared disk) or disk (a PEFT "
    "directory in --sync-dir, /load_lora_adapter)",
    "sync_dir": "directory the disk syncs write and the engines read (default: OUT_DIR/sync)",
    "weight_sync_backend": "backend of SGLang's weight-update group (gloo: CPU, nccl: GPU)",
    "weight_sync_address": "address the trainer's rank 0 hosts the weight-update group on "
    "(one the engines reach)",
    "offload_engines": "release the engines' memory while the trainer steps, resume it before "
    "the weight sync (SGLang's release/resume_memory_occupation; every weight is re-sent)",
    "off_policy_overlap": "off-policy: roll out the next step while the trainer steps (its "
    "samples one weight version stale; needs --tis tis or icepop; metric rollout_staleness)",
    "out_dir": "directory for metrics, checkpoints and plots",
    "resume": "checkpoint directory to continue from",
    "checkpoint_every": "checkpoint every N steps (0: only at the end)",
    "rollout_timeout_s": "seconds one rollout or weight-sync request may take",
    "turn_timeout_s": "seconds one rollout turn may take (at most rollout_timeout_s); past it "
    "the sample is aborted (left out of the step) instead of failing the run",
    "dry_run": "validate and print the config; run nothing",
}
"""One line of help per field; the trainer command line shows it with the default."""


def field_default(name: str) -> Any:
    """The default of a ``GrpoConfig`` field."""
    return _FIELDS[name].default


def field_type(name: str) -> Any:
    """The resolved type of a ``GrpoConfig`` field (``Literal[...]``, ``int | None``, ...)."""
    return _HINTS[name]


def literal_choices(name: str) -> tuple[str, ...]:
    """The allowed values of a ``Literal`` field (empty for other fields)."""
    hint = _HINTS[name]
    return tuple(get_args(hint)) if get_origin(hint) is Literal else ()


def check_http_url(name: str, url: str) -> None:
    """``url`` must be ``http(s)://host[:port][/path]``; the error names ``name``."""
    if not isinstance(url, str):
        raise GrpoConfigError(f"{name} must be a string URL, got {type(url).__name__}", field=name)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port validates it
    except ValueError as exc:
        raise GrpoConfigError(f"{name}={url!r} is not a valid URL: {exc}", field=name) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GrpoConfigError(f"{name}={url!r} must be an http(s) URL with a host", field=name)


_LAYER_TERM = re.compile(r"^\[([01])\]\*(\d+)$")


def parse_moe_layer_freq(text: str, *, num_layers: int | None = None) -> tuple[int, ...]:
    """Megatron's ``--moe-layer-freq`` as one 0/1 entry per layer (1: a MoE layer).

    Reads ``[0]*K+[1]*M``, a list ``[0,1,1]``, or an int N (every Nth layer is MoE, which
    needs ``num_layers``). Only these forms are parsed; the text is never evaluated.
    """
    s = text.replace(" ", "")
    if s.isdigit():
        n = int(s)
        if n < 1:
            raise GrpoConfigError(
                f"moe_layer_freq={text!r}: an every-Nth frequency must be >= 1",
                field="moe_layer_freq",
            )
        if num_layers is None:
            raise GrpoConfigError(
                f"moe_layer_freq={text!r} as an int needs num_layers", field="moe_layer_freq"
            )
        return tuple(1 if i % n == 0 else 0 for i in range(num_layers))
    if s.startswith("[") and s.endswith("]") and "*" not in s:
        items = s[1:-1].split(",") if s[1:-1] else []
        if items and all(i in ("0", "1") for i in items):
            return tuple(int(i) for i in items)
    else:
        out: list[int] = []
        for term in s.split("+"):
            match = _LAYER_TERM.match(term)
            if match is None:
                break
            out.extend([int(match[1])] * int(match[2]))
        else:
            if out:
                return tuple(out)
    raise GrpoConfigError(
        f"moe_layer_freq={text!r} is not '[0]*K+[1]*M', a list of 0/1 like '[0,1,1]', or an int",
        field="moe_layer_freq",
    )


def _check_literal(name: str, value: object) -> None:
    choices = literal_choices(name)
    if choices and value not in choices:
        raise GrpoConfigError(f"{name}={value!r} is not one of {', '.join(choices)}", field=name)


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise GrpoConfigError(f"{name} must be an int, got {value!r}", field=name)
    if value < minimum:
        raise GrpoConfigError(f"{name}={value} must be >= {minimum}", field=name)


def _check_float(name: str, value: object, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GrpoConfigError(f"{name} must be a number, got {value!r}", field=name)
    if not math.isfinite(value):
        raise GrpoConfigError(f"{name}={value} must be finite", field=name)
    if positive and value <= 0:
        raise GrpoConfigError(f"{name}={value} must be > 0", field=name)
    if not positive and value < 0:
        raise GrpoConfigError(f"{name}={value} must be >= 0", field=name)


_FIELDS = {f.name: f for f in fields(GrpoConfig)}
_HINTS = get_type_hints(GrpoConfig)
