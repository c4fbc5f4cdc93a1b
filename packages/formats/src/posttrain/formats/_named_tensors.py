"""Named tensors in SGLang's serialized form, both directions, never unpickling arbitrary input.

SGLang's ``MultiprocessingSerializer`` payloads (``serialized_named_tensors``, one per TP rank,
base64 over HTTP) are pickles. For a payload that crosses hosts the tensors must travel by
value: ``serialize_named_tensors`` pickles a ``{name: tensor}`` dict of CPU tensors (each storage
as ``torch.save`` bytes), the form SGLang's ``load_lora_adapter_from_tensors`` reads.

``deserialize_named_tensors`` reads such a payload with a restricted unpickler: the only globals
it resolves are the tensor rebuild functions and plain containers, and a storage is read with
``torch.load(weights_only=True)``; anything else (a CUDA IPC handle, a callable, a class) is
refused by name with ``NamedTensorsError``. It never runs code from the payload.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.formats._errors import NamedTensorsError

__all__ = ["deserialize_named_tensors", "serialize_named_tensors"]


def serialize_named_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A ``{name: tensor}`` pickle of CPU, contiguous, detached copies (by value)."""
    plain = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)


def _load_storage(data: bytes) -> Any:
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise NamedTensorsError(f"a storage record holds a {type(storage).__name__}")
    return storage


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): getattr(torch._utils, "_rebuild_tensor_v3", None),
    ("torch.storage", "_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "dict"): dict,
    ("builtins", "list"): list,
    ("builtins", "tuple"): tuple,
}
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        found = _ALLOWED.get((module, name))
        if found is None:
            raise NamedTensorsError(
                f"serialized tensors: {module}.{name} is not a tensor record (only plain CPU "
                "tensors by value are read; CUDA IPC handles and code are refused)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise NamedTensorsError("serialized tensors: persistent references are refused")


def deserialize_named_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Read ``serialize_named_tensors``' payload (also a list of ``(name, tensor)`` pairs);
    raises ``NamedTensorsError`` naming what is not a plain named tensor."""
    try:
        obj = _TensorUnpickler(io.BytesIO(data)).load()
    except NamedTensorsError:
        raise
    except Exception as exc:  # a truncated or malformed pickle
        raise NamedTensorsError(
            f"serialized tensors: unreadable ({type(exc).__name__}: {exc})"
        ) from None
    pairs = list(obj.items()) if isinstance(obj, Mapping) else obj
    if not isinstance(pairs, list | tuple):
        raise NamedTensorsError(f"serialized tensors: a {type(obj).__name__}, not named tensors")
    out: dict[str, torch.Tensor] = {}
    for item in pairs:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise NamedTensorsError("serialized tensors: an entry is not a (name, tensor) pair")
        name, t = item
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise NamedTensorsError(f"serialized tensors: entry {name!r} is not a named tensor")
        if name in out:
            raise NamedTensorsError(f"serialized tensors: {name!r} appears twice")
        out[name] = t
    return out
