"""Training state on disk without pickle: named tensors in safetensors, the rest in JSON.

One state file is a ``.safetensors`` file whose header metadata key ``posttrain`` holds a JSON
document (``{"kind": ..., "meta": ...}``). Reading one runs no code: safetensors parses a
length-prefixed JSON header and raw buffers, and JSON is data. This replaces the pickled
``optim.pt`` / ``rng_rank*.pt`` of earlier checkpoints.

Generic pieces (``save_state`` / ``load_state``: a dict of named tensors plus JSON metadata)
and the two users built on them: an optimizer's ``state_dict`` (``save_optimizer`` /
``load_optimizer``; tensors ``state/<param id>/<key>``, non-tensor values and
``param_groups`` in JSON, tuples kept as tuples) and the torch RNG state (``save_rng`` /
``load_rng``). Every failure is a ``GrpoRunError`` naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from posttrain.formats import check_finite
from posttrain.grpo._errors import GrpoRunError

_KEY = "posttrain"
_TUPLE = "__tuple__"
_FLOAT = "__float__"


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE: [_to_json(v, where) for v in value]}
    if isinstance(value, list):
        return [_to_json(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v, where) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise GrpoRunError(f"{where}: a {type(value).__name__} cannot be written as state (JSON only)")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE} and isinstance(value[_TUPLE], list):
            return tuple(_from_json(v) for v in value[_TUPLE])
        if set(value) == {_FLOAT} and value[_FLOAT] in ("inf", "-inf", "nan"):
            return float(value[_FLOAT])
        return {k: _from_json(v) for k, v in value.items()}
    return value


def save_state(
    path: Path, tensors: Mapping[str, torch.Tensor], kind: str, meta: Mapping[str, Any]
) -> None:
    """Write ``tensors`` and JSON ``meta`` (of ``kind``) to the state file ``path``."""
    doc = json.dumps({"kind": kind, "meta": _to_json(dict(meta), str(path))}, allow_nan=False)
    flat = {k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}
    save_file(flat, str(path), metadata={_KEY: doc})


def load_state(path: Path, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read the state file ``path`` written by ``save_state`` with the same ``kind``."""
    if not path.is_file():
        raise GrpoRunError(f"{path.name} is missing ({path})")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open API)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise GrpoRunError(f"{path.name}: not a readable state file ({exc})") from None
    try:
        doc = json.loads(header[_KEY])
    except (KeyError, ValueError):
        raise GrpoRunError(f"{path.name}: its {_KEY!r} metadata is missing or not JSON") from None
    if (
        not isinstance(doc, dict)
        or doc.get("kind") != kind
        or not isinstance(doc.get("meta"), dict)
    ):
        raise GrpoRunError(f"{path.name}: not a {kind} state file")
    return tensors, _from_json(doc["meta"])


def optimizer_state(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's ``state_dict`` as (named tensors, JSON-able metadata)."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, entries in sd["state"].items():
        plain[str(pid)] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):  # a DTensor: this rank's shard
                tensors[f"state/{pid}/{key}"] = getattr(value, "_local_tensor", value)
            else:
                plain[str(pid)][key] = value
    lists: dict[str, int] = {}  # other entries that are lists of tensors (MasterAdamW's masters)
    for key, value in sd.items():
        if key in ("state", "param_groups"):
            continue
        if not isinstance(value, list) or not all(isinstance(t, torch.Tensor) for t in value):
            raise GrpoRunError(f"optimizer state entry {key!r} is not a list of tensors")
        lists[key] = len(value)
        for i, t in enumerate(value):
            tensors[f"list/{key}/{i}"] = getattr(t, "_local_tensor", t)
    return tensors, {"state": plain, "param_groups": sd["param_groups"], "lists": lists}


def optimizer_state_dict(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], what: str
) -> dict[str, Any]:
    """Rebuild a ``state_dict`` from ``optimizer_state``'s output; ``what`` names the source."""
    plain, groups = meta.get("state"), meta.get("param_groups")
    if not isinstance(plain, dict) or not isinstance(groups, list):
        raise GrpoRunError(f"{what}: optimizer state lacks 'state' or 'param_groups'")
    counts = meta.get("lists", {})
    if not isinstance(counts, dict):
        raise GrpoRunError(f"{what}: optimizer state 'lists' is not a mapping")
    state: dict[int, dict[str, Any]] = {}
    lists: dict[str, list[Any]] = {}
    try:
        for key, count in counts.items():
            if key in ("state", "param_groups") or not isinstance(count, int) or count < 0:
                raise ValueError(key)
            lists[str(key)] = [None] * count
        for pid, entries in plain.items():
            state[int(pid)] = dict(entries)
        for name, t in tensors.items():
            prefix, first, rest = name.split("/", 2)
            if prefix == "state":
                state.setdefault(int(first), {})[rest] = t
            elif prefix == "list" and first in lists and 0 <= int(rest) < len(lists[first]):
                lists[first][int(rest)] = t
            else:
                raise ValueError(name)
        if any(t is None for entries in lists.values() for t in entries):
            raise ValueError("a list entry is missing")
    except (ValueError, TypeError):
        raise GrpoRunError(f"{what}: malformed optimizer state entry") from None
    return {"state": state, "param_groups": groups, **lists}


def _local_device(param: torch.Tensor) -> torch.device:
    """The device of ``param``'s local data (a DTensor's shard, or the tensor itself)."""
    return getattr(param, "_local_tensor", param).device


def save_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """Write ``optimizer``'s state to ``path``."""
    tensors, meta = optimizer_state(optimizer)
    save_state(path, tensors, "optimizer", meta)


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    """Load ``path`` (``save_optimizer``) into ``optimizer``; a mismatch names the file."""
    tensors, meta = load_state(path, "optimizer")
    check_finite(tensors.items(), what=path.name, error=GrpoRunError, max_abs=math.inf)
    sd = optimizer_state_dict(tensors, meta, path.name)
    live = [p for group in optimizer.param_groups for p in group["params"]]
    for pid, entries in sd["state"].items():
        if not 0 <= pid < len(live):
            raise GrpoRunError(
                f"{path.name}: state for parameter {pid}, this optimizer has {len(live)}"
            )
        param = live[pid]
        shape = getattr(param, "_local_tensor", param).shape
        for key, t in list(entries.items()):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue
            if t.shape != shape:
                raise GrpoRunError(
                    f"{path.name}: state/{pid}/{key} has shape {list(t.shape)}, its parameter "
                    f"{list(shape)}"
                )
            if hasattr(param, "device_mesh"):  # a sharded parameter: its state shards alike
                from torch.distributed.tensor import DTensor

                entries[key] = DTensor.from_local(
                    t.to(_local_device(param)), param.device_mesh, param.placements,
                    shape=param.shape, stride=param.stride(),
                )  # fmt: skip
    try:
        optimizer.load_state_dict(sd)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise GrpoRunError(f"{path.name}: does not fit this optimizer ({exc})") from None


def save_rng(path: Path) -> None:
    """Write the torch CPU RNG state to ``path``."""
    save_state(path, {"cpu": torch.get_rng_state()}, "rng", {})


def load_rng(path: Path) -> None:
    """Restore the torch CPU RNG state from ``path`` (``save_rng``)."""
    tensors, _ = load_state(path, "rng")
    state = tensors.get("cpu")
    if state is None or state.dtype != torch.uint8 or state.dim() != 1:
        raise GrpoRunError(f"{path.name}: not a torch RNG state")
    try:
        torch.set_rng_state(state)
    except RuntimeError:
        raise GrpoRunError(f"{path.name}: not a torch RNG state (wrong size)") from None
