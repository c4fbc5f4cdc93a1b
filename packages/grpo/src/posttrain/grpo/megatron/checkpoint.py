"""Checkpoints of the megatron backend: layout-free weights, per-rank optimizer state.

Layout of ``iter_N/`` (committed by ``fsdp-mesh``'s ``save_files_checkpoint``, so an
interrupted save never looks complete; ``meta.json`` as on the fsdp backend)::

    model/config.json, model/model.safetensors   full training: the HF checkpoint (gathered
                                                 over TP, rank 0 writes), a model directory
                                                 ``posttrain.models.load_pretrained`` opens
    adapter/                                     adapter training: the PEFT adapter (rank 0)
    layout.json                                  world size, tp, ep, sequence parallel
    optim_rank{r}.safetensors, rng_rank{r}.safetensors
                                                 each rank's optimizer state (its shards) and
                                                 RNG (``_state_files``: no pickle)

The weights carry no layout: they load under any (TP, EP, DP) split (``load``). The
optimizer state is per rank and only restored under the layout it was saved with; under
another one the run continues from the weights with a fresh optimizer and a warning says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from posttrain.formats import write_text_atomic
from posttrain.fsdp_mesh import save_files_checkpoint
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo._state_files import load_optimizer, load_rng, save_optimizer, save_rng
from posttrain.grpo.backend import AdapterTraining, Policy
from posttrain.grpo.checkpoint import rng_file
from posttrain.grpo.masters import MasterAdamW
from posttrain.grpo.megatron.model import TensorParallelDecoder
from posttrain.models import load_hf_tensors, save_hf_weights

_log = logging.getLogger("posttrain.grpo")
LAYOUT = "layout.json"


def _optim_file(path: Path, rank: int) -> Path:
    return path / f"optim_rank{rank}.safetensors"


def _model(policy: Policy) -> TensorParallelDecoder:
    model = policy.model
    if not isinstance(model, TensorParallelDecoder):
        raise GrpoRunError(f"the megatron checkpoint needs its policy, got {type(model).__name__}")
    return model


def _layout(model: TensorParallelDecoder) -> dict[str, Any]:
    g = model.groups
    return {"world_size": g.world_size, "tensor_model_parallel_size": g.tp_size,
            "expert_model_parallel_size": g.ep_size,
            "sequence_parallel": model.sequence_parallel}  # fmt: skip


def save(root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``root`` (collective); returns its directory."""
    model = _model(policy)
    rank = dist.get_rank()
    mode = policy.mode
    if isinstance(mode, AdapterTraining):
        adapter = mode.export()  # collective; the full adapter on every rank
    else:
        weights = model.hf_state_dict()  # collective over TP

    def write(staged: Path) -> None:
        save_rng(rng_file(staged, rank))
        save_optimizer(_optim_file(staged, rank), policy.optimizer)
        if rank != 0:
            return
        write_text_atomic(staged / LAYOUT, json.dumps(_layout(model), indent=2))
        if isinstance(mode, AdapterTraining):
            mode.save(staged / "adapter", adapter)
            return
        save_hf_weights(staged / "model", weights, model.full_config)

    return save_files_checkpoint(root, step, policy.mesh, write, extra=extra)


def load(path: Path, policy: Policy) -> bool:
    """Restore weights (any layout) and, under the saved layout, optimizer and RNG states
    (collective); returns whether the optimizer state was restored."""
    model = _model(policy)
    rank = dist.get_rank()
    layout_file = path / LAYOUT
    if not layout_file.is_file():
        raise GrpoRunError(f"--resume {path}: {LAYOUT} is missing (not a megatron checkpoint)")
    try:
        saved = json.loads(layout_file.read_text())
    except (ValueError, UnicodeDecodeError):
        raise GrpoRunError(f"--resume {path}: {LAYOUT} is not valid JSON") from None
    if isinstance(policy.mode, AdapterTraining):
        policy.mode.load(path / "adapter")
    else:
        model.load_hf_state_dict(load_hf_tensors(path / "model"))
        if isinstance(policy.optimizer, MasterAdamW):  # masters follow the loaded weights
            policy.optimizer.sync_from_parameters()
    if saved != _layout(model):
        if rank == 0:
            _log.warning(
                "--resume %s: saved under %s, resumed under %s: the weights are loaded, the "
                "optimizer and RNG states (per rank) start fresh", path, saved, _layout(model),
            )  # fmt: skip
        return False
    optim, rng = _optim_file(path, rank), rng_file(path, rank)
    for file in (optim, rng):
        if not file.is_file():
            raise GrpoRunError(f"--resume {path}: {file.name} is missing (rank {rank}'s state)")
    try:
        load_optimizer(optim, policy.optimizer)
        load_rng(rng)
    except GrpoRunError as exc:
        raise GrpoRunError(f"--resume {path}: {exc}") from None
    return True
