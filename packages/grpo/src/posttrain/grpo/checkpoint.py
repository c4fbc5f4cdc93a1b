"""Checkpoints a run continues from bit for bit: weights (fp32), optimizer, data position, RNG, step.

Layout under ``<out>/checkpoints`` (the ``fsdp-mesh`` layout and ``meta.json`` in both modes)::

    iter_0000004/
        meta.json                 fsdp-mesh's CheckpointMeta; ``extra``: data position, config
        manifest.json             sha256 and size of every other file (fsdp-mesh)
        adapter/                  adapter training: the PEFT adapter in fp32 (save_peft)
        optim.safetensors         adapter training: the optimizer state (replicated: rank 0)
        .metadata, *.distcp       full training: DCP shards of model + optimizer (every rank)
        rng_rank{r}.safetensors   each rank's torch RNG state
    latest_checkpointed_iteration.txt

Nothing in a checkpoint is unpickled: optimizer and RNG states are ``_state_files`` (safetensors
plus JSON), DCP is read through fsdp-mesh's allow-list reader. ``verify`` (run by ``load``
and by the preflight before anything starts) checks the manifest (a tampered, truncated,
swapped or added file is refused by name; a checkpoint from before manifests is refused), and
adapter or model weights pass the same finiteness and magnitude check as an engine push;
DCP-sharded weights are checked the same way right after they are loaded, before the first
sync.

Both modes commit through ``fsdp-mesh`` (``save_checkpoint`` with DCP shards,
``save_files_checkpoint`` for the adapter): every file, the RNG states included, is written
into ``iter_N.tmp`` before it is swapped in and the tracker moves, so an interrupted save never
looks complete. ``load`` restores after the optimizer is built, straight into the live
parameters and optimizer state (there are no separate masters to re-sync). A run resumed with
the world size it was saved with gets every rank's RNG state back (a missing one is an error;
``restore_rng``); under another world size the RNG states do not map to ranks and are not
restored. Each backend writes its own layout (``TrainerBackend.save_checkpoint``): the one
above is the fsdp backend's (``posttrain.grpo.fsdp_backend``); the megatron backend writes
layout-free files (``posttrain.grpo.megatron.checkpoint``). This module holds what they share:
finding, verifying and loading a checkpoint with one error convention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from posttrain.formats import check_finite
from posttrain.fsdp_mesh import (
    CheckpointError,
    CheckpointMeta,
    checkpoint_dir,
    latest_step,
    verify_checkpoint,
)
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo._state_files import load_rng
from posttrain.grpo.backend import Policy
from posttrain.interface import PosttrainError

TRACKER = "latest_checkpointed_iteration.txt"
OPTIM = "optim.safetensors"
_WEIGHT_DIRS = ("adapter", "model")  # adapter training; the megatron backend's full weights


def rng_file(path: Path, rank: int) -> Path:
    """Rank ``rank``'s torch RNG state in checkpoint directory ``path`` (both backends)."""
    return path / f"rng_rank{rank}.safetensors"


def save(root: Path, step: int, policy: Policy, extra: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``root`` (collective; the policy's backend writes its
    layout); returns its directory."""
    return policy.backend.save_checkpoint(root, step, policy, extra)


def find(path: Path) -> Path:
    """The checkpoint directory ``--resume`` names: an ``iter_*`` dir, a checkpoints root, or a
    run's ``--out`` directory (its newest checkpoint)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        try:
            step = latest_step(root) if root.is_dir() else None
        except (CheckpointError, OSError, UnicodeDecodeError) as exc:
            raise GrpoRunError(f"--resume {path}: {TRACKER} is unreadable ({exc})") from None
        if step is not None:
            return checkpoint_dir(root, step)
    raise GrpoRunError(
        f"--resume {path}: no checkpoint there (expected meta.json, or {TRACKER} in it or in "
        "its checkpoints/ folder)"
    )


def _weight_files(path: Path) -> list[Path]:
    return sorted(f for d in _WEIGHT_DIRS for f in (path / d).glob("*.safetensors"))


def verify(path: Path) -> CheckpointMeta:
    """Check checkpoint ``path`` before anything starts: the manifest (every file's sha256 and
    size, nothing unlisted), ``meta.json``, and every safetensors weight file's values (finite,
    within the push magnitude bound). Each failure is a ``GrpoRunError`` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        meta = verify_checkpoint(path)
    except CheckpointError as exc:
        raise GrpoRunError(f"--resume: {exc}") from None
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                check_finite(
                    ((n, f.get_tensor(n)) for n in names),
                    what=f"--resume {file.relative_to(path)}", error=GrpoRunError,
                )  # fmt: skip
        except (SafetensorError, OSError, ValueError) as exc:
            raise GrpoRunError(f"--resume {file}: unreadable weights ({exc})") from None
    return meta


def restore_rng(path: Path, meta: CheckpointMeta) -> None:
    """Restore this rank's RNG state from checkpoint ``path`` when it was saved with the world
    size the run has now (under another one the states do not map to ranks: left as they are)."""
    if meta.world_size != dist.get_world_size():
        return
    rank = dist.get_rank()
    rng = rng_file(path, rank)
    if not rng.is_file():
        raise GrpoRunError(f"--resume {path}: {rng.name} is missing (rank {rank}'s RNG state)")
    try:
        load_rng(rng)
    except GrpoRunError as exc:
        raise GrpoRunError(f"--resume {path}: {exc}") from None


def load(path: Path, policy: Policy) -> dict[str, Any]:
    """Restore weights, optimizer and RNG into the live policy (collective); returns ``extra``."""
    meta = verify(path)
    try:
        policy.backend.load_checkpoint(path, policy, meta)
    except CheckpointError as exc:
        raise GrpoRunError(f"--resume: {exc}") from None
    except GrpoRunError as exc:
        msg = str(exc)
        raise GrpoRunError(
            msg if msg.startswith("--resume") else f"--resume {path}: {msg}"
        ) from None
    except PosttrainError as exc:  # an adapter or model file the lora/models readers refuse
        raise GrpoRunError(f"--resume {path}: {exc}") from None
    return dict(meta.extra)
