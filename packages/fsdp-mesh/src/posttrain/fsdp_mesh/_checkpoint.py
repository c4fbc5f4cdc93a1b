"""Sharded checkpoints with torch distributed checkpointing (DCP) that reload under any layout.

Layout under ``root``::

    iter_0000042/                      one DCP checkpoint: {"model": ..., "optim": ...}
        .metadata, __*_*.distcp        written by every rank (its own shards only)
        meta.json                      step, layout it was saved with, torch version, extra
    latest_checkpointed_iteration.txt  the newest complete step

DCP stores each tensor's global shape and each shard's offsets, so a checkpoint saved with one
(replicate, shard, W) loads bit-exactly into another: ``load_checkpoint`` reshards on read.

Departures from a plain ``dcp.save``: all ranks write into ``iter_N.tmp`` and rank 0 moves it
to ``iter_N`` only after every rank finished and ``meta.json`` is on disk, then updates the
tracker. Both steps are ``posttrain.formats``' atomic writes (``replace_directory`` fsyncs the
tree and swaps it in; ``write_text_atomic``: temp name, fsync, rename, fsync of the directory).
A crash mid-save therefore never leaves a directory that looks complete. Replicas of a shard
are deduplicated by DCP's planner (one writer per shard).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from posttrain.formats import replace_directory, write_text_atomic
from posttrain.fsdp_mesh._errors import CheckpointError, MeshConfigError
from posttrain.fsdp_mesh._mesh import FsdpMesh

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointMeta:
    """What ``meta.json`` records about a checkpoint (the layout it was *saved* with)."""

    step: int
    world_size: int
    replicate: int
    shard: int
    torch_version: str
    timestamp: float
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    """``root/iter_{step:07d}``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise MeshConfigError(f"checkpoint step must be a non-negative int, got {step!r}")
    return Path(root) / f"iter_{step:07d}"


def latest_step(root: str | os.PathLike[str]) -> int | None:
    """The step in ``root``'s tracker file, or None when nothing was saved yet."""
    tracker = Path(root) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text(encoding="utf-8").strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} holds {text!r}, not a step number") from None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        msd, _ = get_state_dict(model, [])
        return {"model": msd}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    mesh: FsdpMesh,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    write_files: Callable[[Path], None] | None = None,
) -> Path:
    """Save model (and optimizer) shards for ``step``; collective over ``mesh.dp_group``.

    ``write_files(staged_dir)``, when given, runs on every rank after the shards are written and
    before the commit: a caller's own files (RNG states, say) are then part of the checkpoint,
    never added after it looks complete.
    """

    def write(staged: Path) -> None:
        dcp_save(_state(model, optimizer), checkpoint_id=str(staged), process_group=mesh.dp_group)
        if write_files is not None:
            write_files(staged)

    return save_files_checkpoint(root, step, mesh, write, extra=extra)


def save_files_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    mesh: FsdpMesh,
    write_files: Callable[[Path], None],
    *,
    extra: dict[str, Any] | None = None,
) -> Path:
    """The commit protocol of ``save_checkpoint`` around files the caller writes.

    Collective over ``mesh.dp_group``: rank 0 makes ``iter_N.tmp``; every rank calls
    ``write_files(tmp)``; after all finished, rank 0 writes ``meta.json``, swaps the directory
    in and updates the tracker. For state that is not DCP shards (an adapter, say) that must
    still be complete-or-absent and carry the same ``meta.json``.
    """
    final = checkpoint_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    group = mesh.dp_group
    rank = dist.get_rank(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    write_files(tmp)
    dist.barrier(group=group)
    if rank == 0:
        meta = CheckpointMeta(
            step=step,
            world_size=mesh.spec.world_size,
            replicate=mesh.spec.replicate,
            shard=mesh.spec.shard_size,
            torch_version=torch.__version__,
            timestamp=time.time(),
            extra=dict(extra or {}),
        )
        write_text_atomic(tmp / META, json.dumps(asdict(meta), indent=2, sort_keys=True))
        replace_directory(tmp, final)
        write_text_atomic(final.parent / TRACKER, f"{step}\n")
    dist.barrier(group=group)
    return final


def read_meta(path: str | os.PathLike[str]) -> CheckpointMeta:
    """Read ``meta.json`` of the checkpoint directory ``path``."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {META} is missing")
    try:
        data = json.loads(meta_path.read_text(encoding="utf-8"))
        return CheckpointMeta(**data)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{meta_path} is malformed: {exc}") from exc


def load_checkpoint(
    root: str | os.PathLike[str],
    model: nn.Module,
    mesh: FsdpMesh,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
) -> CheckpointMeta:
    """Load ``step`` (default: the tracker's) into ``model``/``optimizer`` sharded on ``mesh``."""
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"no checkpoint in {root}: {TRACKER} is missing")
    path = checkpoint_dir(root, step)
    meta = read_meta(path)
    state = _state(model, optimizer)
    try:
        dcp_load(state, checkpoint_id=str(path), process_group=mesh.dp_group)
    except (CheckpointException, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"rank {dist.get_rank()}: cannot load {path}: {exc}") from exc
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    return meta
