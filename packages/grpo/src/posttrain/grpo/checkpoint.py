"""Checkpoints a run continues from bit for bit: weights (fp32), optimizer, data position, RNG, step.

Layout under ``<out>/checkpoints`` (the ``fsdp-mesh`` layout, so both modes look alike)::

    iter_0000004/
        meta.json                 step, layout, and grpo's ``extra``: data position, config
        adapter/                  adapter training: the PEFT adapter in fp32 (save_peft)
        optim.pt                  adapter training: the optimizer state (replicated: rank 0)
        .metadata, *.distcp       full training: DCP shards of model + optimizer (every rank)
        rng_rank{r}.pt            each rank's torch RNG state
    latest_checkpointed_iteration.txt

Full training uses ``fsdp_mesh.save_checkpoint`` (DCP, atomic, reloads under any layout).
Adapter training writes only the adapter and its optimizer state into a temporary directory
renamed into place once complete, then updates the tracker; an interrupted save never looks
complete. ``resume`` loads after the optimizer is built, straight into the live parameters
and optimizer state (there are no separate masters to re-sync).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.formats import replace_directory, write_text_atomic
from posttrain.fsdp_mesh import (
    checkpoint_dir,
    latest_step,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.trainer import Policy
from posttrain.lora import load_peft, save_peft

TRACKER = "latest_checkpointed_iteration.txt"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


def save(root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``root`` (collective); returns its directory."""
    rank = dist.get_rank()
    if policy.lora is None:
        path = save_checkpoint(root, step, policy.model, policy.mesh, policy.optimizer, extra=extra)
        torch.save(torch.get_rng_state(), path / f"rng_rank{rank}.pt")
        dist.barrier()
        return path
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    from posttrain.lora import export_adapter

    adapter = export_adapter(policy.lora)  # collective; the same full adapter on every rank
    torch.save(torch.get_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        assert policy.lora_config is not None
        save_peft(
            tmp / "adapter", adapter, policy.lora_config, target_modules=policy.target_modules
        )
        torch.save(policy.optimizer.state_dict(), tmp / "optim.pt")
        meta = {"step": step, "world_size": dist.get_world_size(), "extra": extra}
        _write_json(tmp / "meta.json", meta)
    dist.barrier()
    if rank == 0:
        replace_directory(tmp, final)  # complete or absent, never half-written
        write_text_atomic(root / TRACKER, str(step))
    dist.barrier()
    return final


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
    if policy.lora is None:
        load_checkpoint(
            path.parent, policy.model, policy.mesh, policy.optimizer, step=read_meta(path).step
        )
        extra = dict(read_meta(path).extra)
    else:
        meta = json.loads((path / "meta.json").read_text())
        load_peft(policy.lora, path / "adapter", strict=True)
        policy.optimizer.load_state_dict(torch.load(path / "optim.pt", weights_only=False))
        extra = dict(meta["extra"])
    rng = path / f"rng_rank{rank}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=False))
    return extra
