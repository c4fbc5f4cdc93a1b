"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and its default load
planner reads non-tensor values (optimizer hyper-parameters) with ``torch.load(weights_only=False)``:
a planted ``__reduce__`` in either runs in the trainer. ``SafeFileSystemReader`` unpickles the
metadata with an allow-list (DCP's own metadata classes, torch dtypes and sizes, a path) and
``SafeLoadPlanner`` reads byte values with ``torch.load(weights_only=True)``. Anything else in
the pickle is refused with a ``CheckpointError`` naming the file and the global it asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from posttrain.fsdp_mesh._errors import CheckpointError

_EXTRA: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }
)


def _allowed(module: str, name: str) -> Any | None:
    """The object ``module.name`` if the allow-list admits it, else None."""
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module == _md.__name__:
        obj = getattr(_md, name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        return None
    if (module, name) in _EXTRA:
        if module == "torch.serialization":
            return torch.serialization._get_layout
        if module == _fs.__name__:
            return getattr(_fs, name)
        if module == "pathlib":
            return Path
        if module == "collections":
            import collections

            return collections.OrderedDict
        return getattr(torch, name)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise CheckpointError(
                f"{self._source}: refers to {module}.{name}, which a DCP checkpoint's metadata "
                "never holds; refused (nothing from it was run)"
            )
        return obj


def load_metadata(path: str | Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with the allow-list; a ``CheckpointError`` otherwise."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled pickle: any unpickling failure
        why = "missing" if isinstance(exc, FileNotFoundError) else "truncated or garbled"
        raise CheckpointError(f"{source}: unreadable DCP metadata ({why})") from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{source}: holds {type(meta).__name__}, not DCP metadata")
    return meta


class SafeFileSystemReader(_fs.FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = _md.StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception:  # weights_only refuses anything that is not plain data
            raise CheckpointError(
                f"checkpoint value {read_item.dest_index.fqn!r} is not plain data; refused"
            ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
