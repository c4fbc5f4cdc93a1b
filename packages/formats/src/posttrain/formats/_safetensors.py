"""safetensors files, written: the byte layout once, with no numpy.

Layout: an 8-byte little-endian header length, a JSON header (each tensor's ``dtype``,
``shape`` and ``data_offsets`` relative to the data start, plus an optional ``__metadata__``
of strings) padded with spaces to a multiple of 8, then the tensors' bytes back to back in
header order.

Why not the safetensors library's torch writer: it needs numpy (for a data pointer), which
``posttrain-formats`` does not depend on, and it cannot stream a file whose tensors do not fit
in memory together (quant-convert lays the header out first, then appends tensors one at a
time). Reading stays with the library, whose parser bounds-checks the header against the file;
only ``safetensors_metadata`` reads the header's ``__metadata__`` alone, so that a receiver
learns what a body is (a checkpoint's metadata) before decoding it.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import torch

from posttrain.interface import WireFormatError

__all__ = ["SAFETENSORS_DTYPES", "safetensors_header", "tensor_bytes", "write_safetensors"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64",
    torch.uint64: "U64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
"""torch dtype -> safetensors dtype name."""

_ITEM_BYTES = {
    name: torch.empty((), dtype=dt).element_size() for dt, name in SAFETENSORS_DTYPES.items()
}


def safetensors_header(
    layout: Sequence[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """The first bytes of a file holding ``(name, dtype name, shape)`` tensors in this order.

    Returns the 8-byte length plus the padded JSON header, and each tensor's byte size (the
    bytes to append after it, in order). Raises ``ValueError`` for an unknown dtype name or a
    repeated tensor name.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    sizes: list[int] = []
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in _ITEM_BYTES:
            raise ValueError(f"{name}: dtype {dtype!r} is not a safetensors dtype")
        if name in header:
            raise ValueError(f"{name}: named twice")
        n = _ITEM_BYTES[dtype]
        for d in shape:
            n *= int(d)
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape]}
        header[name]["data_offsets"] = [offset, offset + n]
        sizes.append(n)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, sizes


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor (made contiguous), without a copy when it
    already is; the view is valid while the returned object's tensor lives (it keeps it)."""
    if sys.byteorder != "little":  # safetensors is little-endian; so is every host we run on
        raise NotImplementedError("safetensors writing needs a little-endian host")
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    buf = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    buf._tensor = t  # type: ignore[attr-defined]  # keep the storage alive with the view
    return memoryview(buf).cast("B")


def write_safetensors(
    f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (in their order) as one safetensors file to the open binary file ``f``."""
    layout = []
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        layout.append((name, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)))
    head, _ = safetensors_header(layout, metadata)
    f.write(head)
    for t in tensors.values():
        f.write(tensor_bytes(t))


def safetensors_metadata(body: bytes, error: type[WireFormatError]) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes, read from the header alone.

    A body too short, a header that overruns it or is not a JSON object raises ``error`` (the
    caller's format error: a bucket's, an adapter payload's) naming the field.
    """
    if len(body) < 8:
        raise error("body: too short for a safetensors file", field="body")
    (n,) = struct.unpack("<Q", body[:8])
    if n > len(body) - 8:
        raise error(f"body: safetensors header of {n} bytes overruns", field="body")
    try:
        header = json.loads(body[8 : 8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"body: safetensors header is not JSON ({e})", field="body") from e
    if not isinstance(header, dict):
        raise error("body: safetensors header is not an object", field="body")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise error("body: __metadata__ is not an object", field="__metadata__")
    return {str(k): str(v) for k, v in meta.items()}
