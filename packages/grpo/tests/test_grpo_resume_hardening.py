"""Issue 35, finding 1: ``--resume`` runs no code from a checkpoint and refuses a tampered one.

A checkpoint (adapter and full training, one step taken so the optimizer holds state) is saved
by the real code; copies of it are then tampered with. ``checkpoint.verify`` (what the
preflight and ``load`` run first) must refuse every copy whose bytes differ, naming a file;
an intact copy must resume exactly (weights, optimizer state, RNG, data position). Planted
pickles (an old-format ``optim.pt``, a DCP ``.metadata``, a state file, with the manifest
rewritten to match) must never run: the plant would create a marker directory.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import grpo_hardening_workers as workers
import pytest
import torch
from grpo_workers import save_tiny_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.fsdp_mesh import write_manifest
from posttrain.grpo import checkpoint
from posttrain.grpo._errors import GrpoRunError
from posttrain.interface.testing import run_workers

pytestmark = [pytest.mark.multiproc]

TRAINS = ("lora", "full")


class _Plant:
    """Unpickling this creates ``marker``: proof that code from a checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hardening") / "tiny", max_positions=32)


@pytest.fixture(scope="module")
def saved(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for train in TRAINS:
        root = tmp_path_factory.mktemp(f"ckpt-{train}")
        out[train] = run_workers(
            workers.save_after_step, 1, args=(tiny, str(root), train), timeout_s=240
        )[0]
    return out


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _files(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("train", TRAINS)
def test_an_intact_checkpoint_resumes_exactly(
    train: str, tiny: str, saved: dict[str, dict[str, Any]]
) -> None:
    ref = saved[train]
    files = _files(Path(ref["path"]))
    assert "manifest.json" in files
    assert not [f for f in files if f.endswith(".pt")]
    (got,) = run_workers(workers.load_each, 1, args=(tiny, train, [ref["path"]]), timeout_s=240)[0]
    assert isinstance(got, dict), got
    assert got["extra"] == {"next_step": 2, "data_position": 3}
    assert _same(got["weights"], ref["weights"])
    assert got["optim"] == ref["optim"]
    assert torch.equal(got["rng"], ref["rng"])


def _mutate(root: Path, files: list[str], data: st.DataObject) -> set[str]:
    """Apply one random tampering to ``root``; return the names a refusal may cite."""
    kind = data.draw(st.sampled_from(["flip", "truncate", "swap", "add", "delete", "extend"]))
    name = data.draw(st.sampled_from(files))
    path = root / name
    raw = path.read_bytes()
    if kind == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        bit = data.draw(st.integers(0, 7))
        path.write_bytes(raw[:i] + bytes([raw[i] ^ (1 << bit)]) + raw[i + 1 :])
    elif kind == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))])
    elif kind == "extend":
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64)))
    elif kind == "swap":
        other = data.draw(st.sampled_from([f for f in files if f != name]))
        tmp = root / "swap.tmp"
        os.replace(path, tmp)
        os.replace(root / other, path)
        os.replace(tmp, root / other)
        return {name, other}
    elif kind == "add":
        (root / "planted.bin").write_bytes(raw)
        return {"planted.bin"}
    elif kind == "delete":
        path.unlink()
    return {name}


@pytest.mark.parametrize("train", TRAINS)
def test_fuzz_tampered_checkpoints_are_refused_by_name(
    train: str, saved: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    src = Path(saved[train]["path"])
    files = _files(src)
    original = {f: (src / f).read_bytes() for f in files}

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        root = _copy(str(src), tmp_path_factory.mktemp("fuzz") / src.name)
        cited = _mutate(root, files, data)
        now = {f: (root / f).read_bytes() for f in _files(root)}
        if now == original:  # a no-op tampering: the copy must pass
            checkpoint.verify(root)
            return
        with pytest.raises(GrpoRunError) as refused:
            checkpoint.verify(root)
        message = str(refused.value)
        assert any(name in message for name in cited | {"manifest.json"}), message

    one()


def _plant(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(_Plant(str(marker))))


def test_an_old_pickled_checkpoint_is_refused_by_name(
    saved: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    root = _copy(saved["lora"]["path"], tmp_path / "iter_0000001")
    marker = tmp_path / "ran"
    (root / "optim.safetensors").unlink()
    (root / "manifest.json").unlink()
    _plant(root / "optim.pt", marker)
    with pytest.raises(GrpoRunError, match=r"manifest\.json is missing.*written before"):
        checkpoint.verify(root)
    assert not marker.exists()


def test_planted_pickles_never_run_even_with_a_matching_manifest(
    tiny: str, saved: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    cases: dict[str, list[str]] = {"lora": [], "full": []}
    targets = {"lora": ["optim.safetensors", "rng_rank0.safetensors"],
               "full": [".metadata", "rng_rank0.safetensors"]}  # fmt: skip
    for train, names in targets.items():
        for name in names:
            root = _copy(saved[train]["path"], tmp_path / f"{train}-{name}" / "iter_0000001")
            _plant(root / name, marker)
            write_manifest(root)  # the attacker rewrites the manifest too
            checkpoint.verify(root)  # the manifest matches: the loaders are the last line
            cases[train].append(str(root))
    for train, dirs in cases.items():
        got = run_workers(workers.load_each, 1, args=(tiny, train, dirs), timeout_s=240)[0]
        for d, result in zip(dirs, got, strict=True):
            assert isinstance(result, str), f"{d} loaded"
            assert "refused" in result or "not a" in result or "not plain" in result, result
    assert not marker.exists()


def test_garbled_state_with_a_matching_manifest_is_a_named_error(
    tiny: str, saved: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """Byte damage behind a rewritten manifest reaches the parsers: each one ends in a
    GrpoRunError (or an exact load of what is there), never another exception or a hang."""
    dirs: dict[str, list[str]] = {"lora": [], "full": []}
    for train in TRAINS:
        src = Path(saved[train]["path"])
        for i, name in enumerate(f for f in _files(src) if f not in ("manifest.json",)):
            root = _copy(str(src), tmp_path / f"{train}-{i}" / "iter_0000001")
            raw = (root / name).read_bytes()
            (root / name).write_bytes(raw[: len(raw) // 3])
            write_manifest(root)
            dirs[train].append(str(root))
    for train, ds in dirs.items():
        got = run_workers(workers.load_each, 1, args=(tiny, train, ds), timeout_s=300)[0]
        for d, result in zip(ds, got, strict=True):
            assert isinstance(result, str), f"{d}: truncated state loaded"
            assert "Traceback" not in result, result
            assert result.startswith("--resume"), result


@pytest.mark.parametrize(("value", "words"), [(math.nan, "non-finite"), (8.4e37, "magnitude")])
def test_sharded_weights_that_are_not_finite_or_extreme_are_refused_at_load(
    tiny: str, tmp_path: Path, value: float, words: str
) -> None:
    """DCP-sharded weights are checked right after the load, before any sync could send them."""
    got = run_workers(workers.poisoned_full_round_trip, 1, args=(tiny, str(tmp_path), value),
                      timeout_s=240)[0]  # fmt: skip
    assert got != "loaded"
    assert words in got, got
    assert "--resume" in got, got
