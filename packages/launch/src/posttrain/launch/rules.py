"""Rules: from a (model, hardware, nodes) config to engine, router, session and trainer argv.

A rule is a named function that sets flags and environment variables on the roles it cares
about; the name is recorded with every flag so ``Plan.explain()`` can say who set what. Rules
run in a fixed order (base rules, then family/hardware rules, then the user's attention backend
escape hatch); user arguments are appended last by ``build_plan``.

Hardware-specific fixes live here, never in engine or trainer code: e.g. GLM-4.7-Flash on
Blackwell prefills MLA through the paged path (``--flashinfer-mla-disable-ragged``) when the
attention backend is SGLang's default or flashinfer. A user-given ``--attention-backend``
passes through untouched and switches off every rule that would pick or patch a backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from posttrain.launch._errors import LaunchConfigError, UnsupportedHardwareError
from posttrain.launch.args import Args
from posttrain.launch.catalog import Attention, ModelFamily, ModelSpec, mla_lora_targets
from posttrain.launch.hardware import Hardware, Vendor
from posttrain.launch.tables import (
    BACKEND_PRECISIONS,
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_PRECISION,
    ENGINE_KIND,
    FLASHINFER_MLA_BACKENDS,
    PRECISION_GENERATIONS,
    ROLLOUT_TP,
    SUPPORTED_NODES,
    TRAINER_BACKEND,
    TRAINER_TP,
    EngineKind,
    Precision,
    TrainerBackend,
)

TrainMode = Literal["lora", "full"]
TRAINER_LORA_R = 8  # posttrain.grpo's --lora-r default
TRAINER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # its --lora-targets default


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """What a user asks for. Every ``*_args`` tuple is appended verbatim, last."""

    model: ModelSpec
    hardware: Hardware
    nodes: int = 1
    model_path: str | None = None  # default: the model's hub id
    attention_backend: str | None = None  # escape hatch: passed through untouched
    precision: Precision | None = None
    rollout_tp: int | None = None
    rollout_gpus: int | None = None  # default: half the GPUs (whole nodes when nodes > 1)
    session_routers: int = 1
    engine_port: int = 30000
    router_port: int = 8000
    session_router_port: int = 8100
    rendezvous_port: int = 29400
    trainer_module: str = "posttrain.grpo"
    train: TrainMode = "lora"  # what the trainer trains: the adapter or every weight
    engine_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    session_router_args: tuple[str, ...] = ()
    trainer_args: tuple[str, ...] = ()

    @property
    def explicit_backend(self) -> str | None:
        """The backend the user chose: ``--attention-backend``, else the last one in
        ``engine_args`` (either spelling). None when the user chose none."""
        if self.attention_backend is not None:
            return self.attention_backend
        found = None
        args = self.engine_args
        for i, tok in enumerate(args):
            if tok == "--attention-backend" and i + 1 < len(args):
                found = args[i + 1]
            elif tok.startswith("--attention-backend="):
                found = tok.split("=", 1)[1]
        return found

    @property
    def user_backend(self) -> str | None:
        """The user's attention backend; ``default`` means "SGLang's own", i.e. none given."""
        b = self.explicit_backend
        return None if b is None or b == "default" else b


@dataclass(slots=True, kw_only=True)
class Resolved:
    """The config after tables are applied and validated (what rules read)."""

    cfg: LaunchConfig
    rollout_tp: int
    rollout_gpus: int
    trainer_gpus: int
    precision: Precision
    engine_kind: EngineKind
    trainer_backend: TrainerBackend
    trainer_tp: int
    trainer_ep: int
    trainer_replicate: int  # HSDP (fsdp backend): replicate x shard = trainer ranks
    trainer_shard: int
    deferred_precision: Precision | None = None  # the table's recipe this backend cannot run

    @property
    def model(self) -> ModelSpec:
        return self.cfg.model

    @property
    def hardware(self) -> Hardware:
        return self.cfg.hardware


@dataclass(slots=True)
class RoleArgs:
    """Flags and environment per role, each entry remembering its rule."""

    engine: Args = field(default_factory=Args)
    router: Args = field(default_factory=Args)
    session_router: Args = field(default_factory=Args)
    trainer: Args = field(default_factory=Args)
    engine_env: dict[str, tuple[str, str]] = field(default_factory=dict)
    trainer_env: dict[str, tuple[str, str]] = field(default_factory=dict)


def resolve_config(cfg: LaunchConfig) -> Resolved:
    """Apply the tables and validate; every error names the field and value at fault."""
    model, hw = cfg.model, cfg.hardware
    if cfg.train not in ("lora", "full"):
        raise LaunchConfigError(f"train: {cfg.train!r} is not lora or full")
    nodes_ok = SUPPORTED_NODES[model.id][hw]
    if cfg.nodes not in nodes_ok:
        offered = sorted(nodes_ok)
        raise UnsupportedHardwareError(
            f"no launch rule for model {model.id} on ({hw.value}, {cfg.nodes} node(s)); "
            f"{hw.value} supports nodes {offered}"
            if offered
            else f"no launch rule for model {model.id} on ({hw.value}, {cfg.nodes} node(s)); "
            f"{model.id} is not offered on {hw.value}",
            hardware=hw.value,
            nodes=cfg.nodes,
        )
    table_tp = ROLLOUT_TP[model.id][hw]
    tp = cfg.rollout_tp if cfg.rollout_tp is not None else table_tp
    if tp is None or tp < 1:
        raise LaunchConfigError(f"rollout_tp={tp} is invalid for {model.id} on {hw.value}")
    if model.num_attention_heads % tp:
        raise LaunchConfigError(
            f"rollout_tp={tp} does not divide the {model.num_attention_heads} attention heads "
            f"of {model.id}"
        )
    gpn = hw.gpus_per_node
    if gpn and tp > gpn:
        raise LaunchConfigError(
            f"rollout_tp={tp} exceeds the {gpn} GPUs per node of {hw.value} "
            "(an engine does not span nodes in these plans)"
        )
    backend = TRAINER_BACKEND[hw.generation]
    recipe = DEFAULT_PRECISION[model.family][hw.generation]
    precision = cfg.precision or recipe
    if hw.generation not in PRECISION_GENERATIONS[precision]:
        allowed = sorted(g.value for g in PRECISION_GENERATIONS[precision])
        raise LaunchConfigError(
            f"precision={precision.value} needs a {'/'.join(allowed)} GPU; "
            f"hardware {hw.value} is {hw.generation.value}"
        )
    deferred = None
    if precision not in BACKEND_PRECISIONS[backend]:
        if cfg.precision is not None:
            raise LaunchConfigError(
                f"precision={precision.value} training needs Transformer Engine's "
                f"low-precision linears, which the {backend.value} trainer backend does not "
                "use; it trains in bf16 (or nvfp4: bf16 training with NVFP4 rollout weights)"
            )
        precision, deferred = Precision.BF16, recipe
    total = gpn * cfg.nodes
    if total == 0:  # CPU: one engine process and one trainer process
        rollout_gpus, trainer_gpus = 0, 0
    else:
        default = total // 2 if cfg.nodes == 1 else (cfg.nodes // 2) * gpn
        rollout_gpus = cfg.rollout_gpus if cfg.rollout_gpus is not None else default
        trainer_gpus = total - rollout_gpus
        if not 0 < rollout_gpus < total:
            raise LaunchConfigError(
                f"rollout_gpus={rollout_gpus} must leave GPUs for both rollout and training "
                f"out of {total} on {cfg.nodes} x {hw.value}"
            )
        if rollout_gpus % tp:
            raise LaunchConfigError(
                f"rollout_gpus={rollout_gpus} is not a multiple of rollout_tp={tp}"
            )
        if cfg.nodes > 1 and rollout_gpus % gpn:
            raise LaunchConfigError(
                f"rollout_gpus={rollout_gpus} must be whole nodes of {gpn} GPUs when nodes > 1"
            )
    trainer_world = max(trainer_gpus, 1)
    # HSDP: shard over the trainer GPUs of a node, replicate across trainer nodes.
    replicate = trainer_world // gpn if gpn and cfg.nodes > 1 else 1
    shard = trainer_world // replicate
    trainer_tp, trainer_ep = 1, 1
    if backend is TrainerBackend.MEGATRON:
        trainer_tp = TRAINER_TP[model.id]
        if model.num_attention_heads % trainer_tp or trainer_world % trainer_tp:
            raise LaunchConfigError(
                f"trainer tp={trainer_tp} must divide the {model.num_attention_heads} heads and "
                f"the {trainer_world} trainer ranks"
            )
        # Expert parallel: the largest degree <= 8 dividing both the experts and the DP ranks.
        if model.is_moe:
            trainer_ep = math.gcd(model.num_experts, trainer_world // trainer_tp, 8)
    if cfg.session_routers < 1:
        raise LaunchConfigError(f"session_routers={cfg.session_routers} must be >= 1")
    return Resolved(
        cfg=cfg,
        rollout_tp=tp,
        rollout_gpus=rollout_gpus,
        trainer_gpus=trainer_gpus,
        precision=precision,
        engine_kind=ENGINE_KIND[hw.generation],
        trainer_backend=backend,
        trainer_tp=trainer_tp,
        trainer_ep=trainer_ep,
        trainer_replicate=replicate,
        trainer_shard=shard,
        deferred_precision=deferred,
    )


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    applies: Callable[[Resolved], bool]
    apply: Callable[[Resolved, RoleArgs, str], None]


def _base_engine(r: Resolved, a: RoleArgs, src: str) -> None:
    path = r.cfg.model_path or r.model.hf_id
    a.engine.set("--model-path", path, source=src)
    a.engine.set("--host", "{node_ip}", source=src)
    if r.engine_kind is EngineKind.SGLANG:
        a.engine.set("--tp-size", r.rollout_tp, source=src + " (rollout_tp table)")
        a.engine.set("--trust-remote-code", source=src)


def _base_router(r: Resolved, a: RoleArgs, src: str) -> None:
    a.router.set("--host", "{node_ip}", source=src)
    a.router.set("--port", r.cfg.router_port, source=src)
    # Sessions: one routing key sticks to one worker (KV prefix reuse); new keys to the
    # least-loaded worker rather than a random one.
    a.router.set("--policy", "manual", source=src + " (sessions on)")
    a.router.set("--assignment-mode", "min_load", source=src + " (sessions on)")
    a.router.set("--request-timeout-secs", 14400, source=src)
    a.router.set("--log-level", "warn", source=src)


def _base_session_router(r: Resolved, a: RoleArgs, src: str) -> None:
    a.session_router.set("--upstream", f"http://{{node_ip:0}}:{r.cfg.router_port}", source=src)
    a.session_router.set("--tokenizer", r.cfg.model_path or r.model.hf_id, source=src)
    a.session_router.set("--host", "{node_ip}", source=src)


def _base_trainer(r: Resolved, a: RoleArgs, src: str) -> None:
    m = r.model
    a.trainer.set("--model-path", r.cfg.model_path or m.hf_id, source=src)
    a.trainer.set("--rollout-url", f"http://{{node_ip:0}}:{r.cfg.session_router_port}", source=src)
    a.trainer.set(
        "--router-url",
        f"http://{{node_ip:0}}:{r.cfg.router_port}",
        source=src + " (a lost engine is deregistered there until it has the weights again)",
    )
    a.trainer.set("--backend", r.trainer_backend.value, source=src + " (trainer backend table)")
    if m.attention is Attention.MLA:  # no k_proj/v_proj: the attention targets are MLA's own
        targets = mla_lora_targets(["q_proj", "k_proj", "v_proj", "o_proj"])
        a.trainer.set("--lora-targets", ",".join(targets), source=src + " (MLA projections)")
    if r.trainer_backend is TrainerBackend.FSDP:
        hsdp = src + " (HSDP: shard within a node, replicate across nodes)"
        a.trainer.set("--replicate", r.trainer_replicate, source=hsdp)
        a.trainer.set("--shard", r.trainer_shard, source=hsdp)
    if r.trainer_backend is TrainerBackend.MEGATRON:
        a.trainer.set(
            "--tensor-model-parallel-size", r.trainer_tp, source=src + " (trainer tp table)"
        )
        if r.trainer_tp > 1:
            a.trainer.set(
                "--sequence-parallel", source=src + " (activations sharded over the TP group)"
            )
        a.trainer.set("--num-layers", m.num_layers, source=src)
        if m.is_moe:
            a.trainer.set("--expert-model-parallel-size", r.trainer_ep, source=src)
            a.trainer.set("--num-experts", m.num_experts, source=src)
            a.trainer.set("--moe-layer-freq", m.moe_layer_freq, source=src)
        if r.hardware.vendor is Vendor.NVIDIA:
            a.trainer_env["CUDA_DEVICE_MAX_CONNECTIONS"] = ("1", src + " (megatron overlap)")


def _user_trainer_value(cfg: LaunchConfig, flag: str) -> str | None:
    """The last value the user's trainer args give ``flag`` (``--flag v`` or ``--flag=v``)."""
    found = None
    args = cfg.trainer_args
    for i, tok in enumerate(args):
        if tok == flag and i + 1 < len(args):
            found = args[i + 1]
        elif tok.startswith(flag + "="):
            found = tok.split("=", 1)[1]
    return found


def _weight_sync(r: Resolved, a: RoleArgs, src: str) -> None:
    cfg = r.cfg
    a.trainer.set(
        "--train", cfg.train,
        source=f"{src} (lora: only the adapter travels to the engines; full: every weight)",
    )  # fmt: skip
    if cfg.train == "lora":
        a.trainer.set(
            "--lora-sync", "tensors",
            source=f"{src} (the adapter travels in SGLang's load_lora_adapter_from_tensors "
            "body: no disk shared between trainer and engines needed)",
        )  # fmt: skip
    else:
        if _user_trainer_value(cfg, "--weight-sync") == "tensor":
            raise LaunchConfigError(
                "trainer args --weight-sync tensor: it hands CUDA IPC handles to engines "
                "colocated on the trainer's own GPUs, and these plans never colocate them "
                "(engines and trainer get separate GPUs); use --weight-sync distributed"
            )
        a.trainer.set(
            "--weight-sync", "distributed",
            source=f"{src} (disaggregated engines: SGLang's update group, no shared disk; "
            "--weight-sync tensor (CUDA IPC) needs engines colocated on the trainer's GPUs, "
            "which these plans never do)",
        )  # fmt: skip
    if r.hardware.gpus_per_node:
        a.trainer.set(
            "--weight-sync-backend", "nccl",
            source=f"{src} (engines on their own GPUs: SGLang's distributed weight update, "
            "the trainer's rank 0 broadcasting over NCCL)",
        )  # fmt: skip
    else:
        a.trainer.set(
            "--weight-sync-backend", "gloo",
            source=f"{src} (CPU engines: the update group over gloo)",
        )  # fmt: skip
    a.trainer.set(
        "--weight-sync-address", "{node_ip}",
        source=f"{src} (the update group is hosted by the trainer's rank 0, on its own node)",
    )  # fmt: skip
    if cfg.train != "lora" or not _is_sglang(r):
        return
    rank = _user_trainer_value(cfg, "--lora-r") or TRAINER_LORA_R
    targets = _user_trainer_value(cfg, "--lora-targets")
    planned = a.trainer.get("--lora-targets")  # a rule's choice (MLA: its own projections)
    if not targets and planned:
        targets = planned[0]
    modules = tuple(targets.split(",")) if targets else TRAINER_LORA_TARGETS
    why = f"{src} (the trainer trains a LoRA adapter: the engines must serve it)"
    a.engine.set("--enable-lora", source=why)
    a.engine.set("--max-lora-rank", rank, source=f"{why}; the trainer's --lora-r")
    a.engine.set("--lora-target-modules", *modules, source=f"{why}; the trainer's --lora-targets")


def _precision(r: Resolved, a: RoleArgs, src: str) -> None:
    p = r.precision
    if r.deferred_precision is not None:
        src = (
            f"{src} ({p.value}; the {r.deferred_precision.value} recipe needs Transformer "
            "Engine, which the trainer backends do not use)"
        )
    else:
        src = f"{src} ({p.value})"
    if p is Precision.BF16:
        a.trainer.set("--bf16", source=src)
        return
    # only nvfp4 gets here (BACKEND_PRECISIONS): bf16 training, NVFP4 rollout weights
    a.trainer.set("--bf16", source=src)
    a.trainer.set("--rollout-quant", "nvfp4", source=src)
    a.engine.set("--quantization", "modelopt_fp4", source=src)


def _family_backend(r: Resolved, a: RoleArgs, src: str) -> None:
    backend = DEFAULT_ATTENTION_BACKEND[r.model.family][r.hardware.generation]
    a.engine.set("--attention-backend", backend or "", source=src)


def _glm_flash_blackwell_mla(r: Resolved, a: RoleArgs, src: str) -> None:
    a.engine.set("--flashinfer-mla-disable-ragged", source=src)


def _amd_aiter(r: Resolved, a: RoleArgs, src: str) -> None:
    a.engine_env["SGLANG_USE_AITER"] = ("1", src)


def _user_attention_backend(r: Resolved, a: RoleArgs, src: str) -> None:
    a.engine.set("--attention-backend", r.cfg.attention_backend or "", source=src)


def _is_sglang(r: Resolved) -> bool:
    return r.engine_kind is EngineKind.SGLANG


RULES: tuple[Rule, ...] = (
    Rule("base_engine", lambda r: True, _base_engine),
    Rule("base_router", lambda r: True, _base_router),
    Rule("base_session_router", lambda r: True, _base_session_router),
    Rule("base_trainer", lambda r: True, _base_trainer),
    Rule("weight_sync", lambda r: True, _weight_sync),
    Rule("precision", lambda r: True, _precision),
    Rule(
        "family_attention_backend",
        lambda r: (
            _is_sglang(r)
            and r.cfg.user_backend is None
            and DEFAULT_ATTENTION_BACKEND[r.model.family][r.hardware.generation] is not None
        ),
        _family_backend,
    ),
    Rule(
        "glm47_flash_blackwell_paged_mla_prefill",
        lambda r: (
            _is_sglang(r)
            and r.model.family is ModelFamily.GLM4_MOE_LITE
            and r.model.attention is Attention.MLA
            and r.hardware.is_blackwell
            and r.cfg.explicit_backend in FLASHINFER_MLA_BACKENDS
        ),
        _glm_flash_blackwell_mla,
    ),
    Rule("amd_aiter", lambda r: _is_sglang(r) and r.hardware.vendor is Vendor.AMD, _amd_aiter),
    Rule(
        "user --attention-backend (escape hatch)",
        # Only for the dedicated option: a backend inside engine_args is already in the argv.
        lambda r: (
            _is_sglang(r)
            and r.cfg.attention_backend is not None
            and r.cfg.attention_backend != "default"
        ),
        _user_attention_backend,
    ),
)


def apply_rules(r: Resolved) -> tuple[RoleArgs, list[str]]:
    """Run every applicable rule in order; returns the role args and the rules that fired."""
    role_args = RoleArgs()
    fired = []
    for rule in RULES:
        if rule.applies(r):
            rule.apply(r, role_args, rule.name)
            fired.append(rule.name)
    role_args.engine.extend_user(r.cfg.engine_args)
    role_args.router.extend_user(r.cfg.router_args)
    role_args.session_router.extend_user(r.cfg.session_router_args)
    role_args.trainer.extend_user(r.cfg.trainer_args)
    return role_args, fired
