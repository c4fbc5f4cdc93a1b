"""Checkpoints a run continues from bit for bit: weights (fp32), optimizer, data position, RNG, step.

Layout under ``<out>/checkpoints`` (the ``fsdp-mesh`` layout and ``meta.json`` in both modes)::

    iter_0000004/
        meta.json                 fsdp-mesh's CheckpointMeta; ``extra``: data position, config
        adapter/                  adapter training: the PEFT adapter in fp32 (save_peft)
        optim.pt                  adapter training: the optimizer state (replicated: rank 0)
        .metadata, *.distcp       full training: DCP shards of model + optimizer (every rank)
        rng_rank{r}.pt            each rank's torch RNG state
    latest_checkpointed_iteration.txt

Both modes commit through ``fsdp-mesh`` (``save_checkpoint`` with DCP shards,
``save_files_checkpoint`` for the adapter): every file, the RNG states included, is written
into ``iter_N.tmp`` before it is swapped in and the tracker moves, so an interrupted save never
looks complete. ``load`` restores after the optimizer is built, straight into the live
parameters and optimizer state (there are no separate masters to re-sync). A run resumed with
the world size it was saved with gets every rank's RNG state back (a missing one is an error);
under another world size the RNG states do not map to ranks and are not restored. The
megatron backend writes its own layout-free files (``posttrain.grpo.megatron.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.fsdp_mesh import (
    CheckpointError,
    checkpoint_dir,
    latest_step,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    save_files_checkpoint,
)
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.trainer import Policy
from posttrain.lora import export_adapter, load_peft, save_peft

TRACKER = "latest_checkpointed_iteration.txt"


def rng_file(path: Path, rank: int) -> Path:
    """Rank ``rank``'s torch RNG state in checkpoint directory ``path`` (both backends)."""
    return path / f"rng_rank{rank}.pt"


def save(root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``root`` (collective); returns its directory."""
    if policy.backend == "megatron":
        from posttrain.grpo.megatron import checkpoint as megatron_checkpoint

        return megatron_checkpoint.save(root, step, policy, extra)
    rank = dist.get_rank()

    def write_rng(staged: Path) -> None:
        torch.save(torch.get_rng_state(), rng_file(staged, rank))

    if policy.lora is None:
        return save_checkpoint(
            root, step, policy.model, policy.mesh, policy.optimizer,
            extra=extra, write_files=write_rng,
        )  # fmt: skip
    adapter = export_adapter(policy.lora)  # collective; the same full adapter on every rank

    def write_adapter(staged: Path) -> None:
        write_rng(staged)
        if rank == 0:  # the adapter and its optimizer state are replicated
            assert policy.lora_config is not None
            save_peft(
                staged / "adapter", adapter, policy.lora_config,
                target_modules=policy.target_modules,
            )  # fmt: skip
            torch.save(policy.optimizer.state_dict(), staged / "optim.pt")

    return save_files_checkpoint(root, step, policy.mesh, write_adapter, extra=extra)


def find(path: Path) -> Path:
    """The checkpoint directory ``--resume`` names: an ``iter_*`` dir, a checkpoints root, or a
    run's ``--out`` directory (its newest checkpoint)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        step = latest_step(root) if root.is_dir() else None
        if step is not None:
            return checkpoint_dir(root, step)
    raise GrpoRunError(
        f"--resume {path}: no checkpoint there (expected meta.json, or {TRACKER} in it or in "
        "its checkpoints/ folder)"
    )


def load(path: Path, policy: Policy) -> dict[str, Any]:
    """Restore weights, optimizer and RNG into the live policy (collective); returns ``extra``."""
    rank = dist.get_rank()
    try:
        meta = read_meta(path)
    except CheckpointError as exc:
        raise GrpoRunError(f"--resume: {exc}") from exc
    if policy.backend == "megatron":
        from posttrain.grpo.megatron import checkpoint as megatron_checkpoint

        megatron_checkpoint.load(path, policy)
        return dict(meta.extra)
    if policy.lora is None:
        load_checkpoint(path.parent, policy.model, policy.mesh, policy.optimizer, step=meta.step)
    else:
        load_peft(policy.lora, path / "adapter", strict=True)
        policy.optimizer.load_state_dict(torch.load(path / "optim.pt", weights_only=False))
    if meta.world_size == dist.get_world_size():
        rng = rng_file(path, rank)
        if not rng.is_file():
            raise GrpoRunError(f"--resume {path}: {rng.name} is missing (rank {rank}'s RNG state)")
        torch.set_rng_state(torch.load(rng, weights_only=False))
    return dict(meta.extra)
