"""The policy on the trainer ranks: pick the backend, build the policy, take one GRPO step.

``backend_for`` maps ``GrpoConfig.backend`` to its ``TrainerBackend`` (``posttrain.grpo.backend``):
``fsdp`` (``posttrain.grpo.fsdp_backend``) or ``megatron`` (``posttrain.grpo.megatron.backend``,
imported only when chosen, and importing no megatron-core itself). ``build_policy`` builds the
policy with the configured backend; ``train_step`` and ``compute_gradients`` (``posttrain.grpo.step``)
run the shared step under the rules of the backend that built the policy. The samples a
step takes are ``TrainSample``s (``posttrain.grpo.batch``).

This module re-exports the names the loop, the tests and the benchmarks use, so they need not
know which module of the trainer holds them.
"""

from __future__ import annotations

from posttrain.grpo.backend import (
    AdapterTraining,
    DataContextParallel,
    FullTraining,
    Policy,
    TrainerBackend,
    TrainMode,
    data_context_parallel,
)
from posttrain.grpo.batch import TrainSample, expand_sample_media, micro_batches
from posttrain.grpo.config import Backend, GrpoConfig
from posttrain.grpo.fsdp_backend import FSDP, fused_adamw, lora_targets, shard_policy
from posttrain.grpo.step import MAX_METRICS, SUM_METRICS, compute_gradients, train_step

__all__ = [
    "MAX_METRICS",
    "SUM_METRICS",
    "AdapterTraining",
    "DataContextParallel",
    "FullTraining",
    "Policy",
    "TrainMode",
    "TrainSample",
    "TrainerBackend",
    "backend_for",
    "build_policy",
    "compute_gradients",
    "data_context_parallel",
    "expand_sample_media",
    "fused_adamw",
    "lora_targets",
    "micro_batches",
    "shard_policy",
    "train_step",
]


def _megatron() -> TrainerBackend:
    from posttrain.grpo.megatron.backend import MEGATRON

    return MEGATRON


_BACKENDS = {"fsdp": lambda: FSDP, "megatron": _megatron}


def backend_for(name: Backend) -> TrainerBackend:
    """The ``TrainerBackend`` named ``name`` (``GrpoConfig.backend``)."""
    return _BACKENDS[name]()


def build_policy(cfg: GrpoConfig) -> Policy:
    """Load, split and (``cfg.train == "lora"``) adapt the policy on this rank (CPU) with the
    configured backend; collective."""
    return backend_for(cfg.backend).build_policy(cfg)
