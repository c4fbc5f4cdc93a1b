"""The ``megatron`` trainer backend: ``TrainerBackend`` over a ``TensorParallelDecoder``.

The step is the shared one (``posttrain.grpo.step``) with this backend's rules: no FSDP, so
gradients add up over micro-batches and are reduced once after the last (``grads`` for full
training, lora-core for the adapter); each loss is scaled by the data-parallel size (the TP
ranks of one group share their samples) and the TP group's rank 0 reports the metrics. The
weights go to the engines gathered over TP into HF names; checkpoints are layout-free
(``checkpoint``).

Importing this module imports no megatron-core: the modules that do (``policy``, ``model``,
``grads``, ``checkpoint``) are imported when a method needs them, so choosing the backend by
name (``posttrain.grpo.trainer.backend_for``) stays cheap.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from posttrain.fsdp_mesh import CheckpointMeta
from posttrain.grpo._errors import GrpoConfigError, GrpoUnsupportedError
from posttrain.grpo.backend import AdapterTraining, NoAccumulation, Policy, StepRules
from posttrain.grpo.config import Backend, GrpoConfig
from posttrain.models import ModelConfig


class MegatronBackend:
    """The ``megatron`` ``TrainerBackend``: tensor / sequence / expert parallel."""

    @property
    def name(self) -> Backend:
        return "megatron"

    def preload(self) -> None:
        """Import megatron-core (~10 s) once in the parent, not in every forked rank."""
        import posttrain.grpo.megatron.layers  # noqa: F401

    def check_model(self, cfg: GrpoConfig, model: ModelConfig, location: str) -> None:
        if model.qkv_bias:
            # the megatron backend's parallel qkv linear has no bias: it would be dropped
            raise GrpoConfigError(
                f"--backend megatron: {location} has q/k/v biases ({model.family} family), "
                "which the megatron backend's parallel linears do not build; use --backend fsdp",
                field="backend",
            )

    def describe_ranks(self, cfg: GrpoConfig, world: int) -> str:
        tp, ep = cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size
        sp = " (sequence parallel)" if cfg.sequence_parallel else ""
        return (
            f"trainer ranks: {world} = {tp} tensor parallel{sp} x {world // tp} data "
            f"parallel; experts over {ep} expert parallel x {world // ep} expert data parallel"
        )

    def build_policy(self, cfg: GrpoConfig) -> Policy:
        if importlib.util.find_spec("megatron") is None:
            raise GrpoUnsupportedError(
                "backend",
                "--backend megatron needs megatron-core, which is not installed: "
                "pip install 'posttrain-grpo[megatron]' (Linux)",
            )
        from posttrain.grpo.megatron.policy import build_megatron_policy

        return build_megatron_policy(cfg, self)

    def step_rules(self, policy: Policy) -> StepRules:
        """Plain accumulation, one explicit reduction, the loss scaled by the DP size."""
        from posttrain.grpo.megatron import grads
        from posttrain.grpo.megatron.model import TensorParallelDecoder

        model, mode = policy.model, policy.mode
        assert isinstance(model, TensorParallelDecoder)
        assert policy.parallel is not None

        def reduce() -> float:
            if isinstance(mode, AdapterTraining):
                return mode.reduce_gradients()
            params = policy.trainable()
            grads.reduce_gradients(model, params)
            return grads.grad_norm(model, params)

        return StepRules(
            accumulation=NoAccumulation.over,
            loss_scale=policy.parallel.dp_size,
            reduce_gradients=reduce,
            reports_metrics=int(model.groups.tp_rank) == 0,
        )

    def export_weights(self, policy: Policy) -> dict[str, Tensor]:
        if isinstance(policy.mode, AdapterTraining):
            return policy.mode.export()
        from posttrain.grpo.megatron.model import TensorParallelDecoder

        model = policy.model
        assert isinstance(model, TensorParallelDecoder)
        hf = model.hf_state_dict()  # collective over TP: shards gathered to HF names
        return hf if dist.get_rank() == 0 else {}

    def save_checkpoint(self, root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
        from posttrain.grpo.megatron import checkpoint

        return checkpoint.save(root, step, policy, extra)

    def load_checkpoint(self, path: Path, policy: Policy, meta: CheckpointMeta) -> None:
        from posttrain.grpo.megatron import checkpoint

        checkpoint.load(path, policy)


MEGATRON = MegatronBackend()
