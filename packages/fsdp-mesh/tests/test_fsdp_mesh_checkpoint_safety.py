"""Checkpoint safety (issue 35): the manifest refuses changed, missing, added and linked files by
name, and DCP metadata is unpickled through an allow-list, so a planted ``__reduce__`` never
runs. The checkpoint here is a real DCP save (no process group) of a real optimizer state."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from posttrain.fsdp_mesh import CheckpointError, verify_checkpoint, write_manifest
from posttrain.fsdp_mesh._dcp_safe import SafeFileSystemReader, SafeLoadPlanner, load_metadata


class _Plant:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    root = tmp_path / "iter_0000001"
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp_save(state, checkpoint_id=str(root), no_dist=True)
    meta = {"step": 1, "world_size": 1, "replicate": 1, "shard": 1,
            "torch_version": torch.__version__, "timestamp": time.time(), "extra": {}}  # fmt: skip
    (root / "meta.json").write_text(json.dumps(meta))
    write_manifest(root)
    return root


def test_an_intact_checkpoint_verifies_and_loads_through_the_safe_reader(ckpt: Path) -> None:
    assert verify_checkpoint(ckpt).step == 1
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp_load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner(),
             no_dist=True)  # fmt: skip
    assert state["optim"]["param_groups"][0]["betas"] == (0.8, 0.9)


@pytest.mark.parametrize("change", ["flip", "truncate", "delete", "add", "symlink"])
def test_the_manifest_refuses_a_changed_checkpoint_by_name(ckpt: Path, change: str) -> None:
    shard = next(ckpt.glob("*.distcp"))
    raw = shard.read_bytes()
    if change == "flip":
        shard.write_bytes(raw[:10] + bytes([raw[10] ^ 1]) + raw[11:])
        name = shard.name
    elif change == "truncate":
        shard.write_bytes(raw[:-1])
        name = shard.name
    elif change == "delete":
        shard.unlink()
        name = shard.name
    elif change == "add":
        (ckpt / "extra.bin").write_bytes(b"x")
        name = "extra.bin"
    else:
        shard.unlink()
        target = ckpt.parent / "outside.bin"
        target.write_bytes(raw)
        shard.symlink_to(target)
        name = shard.name
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        verify_checkpoint(ckpt)


def test_a_checkpoint_without_a_manifest_is_refused_as_old(ckpt: Path) -> None:
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing.*written before"):
        verify_checkpoint(ckpt)


def test_a_planted_metadata_pickle_never_runs(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Plant(str(marker))))
    write_manifest(ckpt)  # an attacker can rewrite the manifest: the unpickler still holds
    verify_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"posix\.mkdir.*refused"):
        load_metadata(ckpt / ".metadata")
    assert not marker.exists()


def test_a_truncated_metadata_pickle_is_a_named_error(ckpt: Path) -> None:
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable DCP metadata"):
        load_metadata(ckpt / ".metadata")
