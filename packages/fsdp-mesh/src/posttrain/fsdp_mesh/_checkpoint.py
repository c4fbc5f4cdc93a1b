"""Sharded checkpoints with torch distributed checkpointing (DCP) that reload under any layout.

Layout under ``root``::

    iter_0000042/                      one DCP checkpoint: {"model": ..., "optim": ...}
        .metadata, __*_*.distcp        written by every rank (its own shards only)
        meta.json                      step, layout it was saved with, torch version, extra
        manifest.json                  sha256 and size of every other file (checked at load)
    latest_checkpointed_iteration.txt  the newest complete step

DCP stores each tensor's global shape and each shard's offsets, so a checkpoint saved with one
(replicate, shard, W) loads bit-exactly into another: ``load_checkpoint`` reshards on read.

Departures from a plain ``dcp.save``: all ranks write into ``iter_N.tmp`` and rank 0 moves it
to ``iter_N`` only after every rank finished and ``meta.json`` is on disk, then updates the
tracker. Both steps are ``posttrain.formats``' atomic writes (``replace_directory`` fsyncs the
tree and swaps it in; ``write_text_atomic``: temp name, fsync, rename, fsync of the directory).
A crash mid-save therefore never leaves a directory that looks complete. Replicas of a shard
are deduplicated by DCP's planner (one writer per shard).

Loading runs no code from the checkpoint: ``verify_checkpoint`` first checks ``manifest.json``
(every file listed, a regular file of the listed size and sha256, nothing unlisted; a
checkpoint without a manifest was written before it existed and is refused by name), then DCP
reads through ``_dcp_safe`` (allow-list unpickler for ``.metadata``, ``weights_only`` for
values).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
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
from posttrain.fsdp_mesh._dcp_safe import SafeFileSystemReader, SafeLoadPlanner
from posttrain.fsdp_mesh._errors import CheckpointError, MeshConfigError
from posttrain.fsdp_mesh._mesh import FsdpMesh

TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "posttrain-checkpoint-manifest/1"


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
        write_manifest(tmp)
        replace_directory(tmp, final)
        write_text_atomic(final.parent / TRACKER, f"{step}\n")
    dist.barrier(group=group)
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(path: Path) -> dict[str, Path]:
    """Every entry under ``path`` (recursively) but the manifest, by relative POSIX name."""
    return {
        p.relative_to(path).as_posix(): p
        for p in sorted(path.rglob("*"))
        if not (p.is_dir() and not p.is_symlink()) and p.relative_to(path).as_posix() != MANIFEST
    }


def write_manifest(path: str | os.PathLike[str]) -> None:
    """Write ``manifest.json`` into checkpoint directory ``path``: sha256 and size per file."""
    root = Path(path)
    files = {
        name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for name, p in _files(root).items()
    }
    doc = {"format": MANIFEST_FORMAT, "files": files}
    write_text_atomic(root / MANIFEST, json.dumps(doc, indent=1, sort_keys=True))


def _read_manifest(root: Path) -> dict[str, dict[str, Any]]:
    manifest = root / MANIFEST
    if not manifest.is_file() or manifest.is_symlink():
        raise CheckpointError(
            f"{root}: {MANIFEST} is missing: a checkpoint written before posttrain checked "
            "checkpoints (its state files may hold pickles, which are never loaded), or not a "
            "checkpoint at all; refused"
        )
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{manifest} is not valid JSON; refused") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
    ):
        raise CheckpointError(f"{manifest} is not a {MANIFEST_FORMAT} manifest; refused")
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("bytes"), int)
            or name.startswith("/")
            or ".." in name.split("/")
        ):
            raise CheckpointError(f"{manifest}: entry {name!r} is malformed; refused")
    return files


def verify_checkpoint(path: str | os.PathLike[str]) -> CheckpointMeta:
    """Check checkpoint directory ``path`` against its manifest and read its ``meta.json``.

    Refuses, naming the file: a missing manifest, a listed file that is missing, not a regular
    file (a symlink, say), of another size or sha256, and any file the manifest does not list.
    Reads every byte once; runs nothing.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a checkpoint directory")
    listed = _read_manifest(root)
    present = _files(root)
    for name in sorted(present.keys() - listed.keys()):
        raise CheckpointError(f"{root}: {name} is not in {MANIFEST} (added or renamed); refused")
    for name, entry in sorted(listed.items()):
        file = root / name
        try:
            st = os.lstat(file)
        except OSError:
            raise CheckpointError(f"{root}: {name} is missing (listed in {MANIFEST})") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{root}: {name} is not a regular file; refused")
        if st.st_size != entry["bytes"]:
            raise CheckpointError(
                f"{root}: {name} has {st.st_size} bytes, {MANIFEST} says {entry['bytes']} "
                "(truncated or replaced); refused"
            )
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(
                f"{root}: {name} does not match its sha256 in {MANIFEST} (changed); refused"
            )
    return read_meta(root)


def read_meta(path: str | os.PathLike[str]) -> CheckpointMeta:
    """Read ``meta.json`` of the checkpoint directory ``path``."""
    meta_path = Path(path) / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {META} is missing")
    try:
        data = json.loads(meta_path.read_text(encoding="utf-8"))
        meta = CheckpointMeta(**data)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{meta_path} is malformed: {exc}") from None
    for name in ("step", "world_size", "replicate", "shard"):
        value = getattr(meta, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{meta_path}: {name} is {value!r}, not a non-negative int")
    if not isinstance(meta.extra, dict):
        raise CheckpointError(f"{meta_path}: extra is not an object")
    return meta


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
    meta = verify_checkpoint(path)
    state = _state(model, optimizer)
    try:
        dcp_load(
            state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
            process_group=mesh.dp_group,
        )  # fmt: skip
    except CheckpointException as exc:  # DCP's wrapper of every rank's failure
        causes = "; ".join(str(failure) for failure, _ in exc.failures.values())
        raise CheckpointError(f"rank {dist.get_rank()}: cannot load {path}: {causes}") from None
    except (CheckpointError, RuntimeError, KeyError, ValueError, OSError) as exc:
        raise CheckpointError(f"rank {dist.get_rank()}: cannot load {path}: {exc}") from None
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    return meta
