"""Header-only safetensors reading, ranged tensor reads, and a streaming atomic shard writer.

Why not ``safetensors.safe_open``: it maps the whole file, so its pages count towards RSS
and the bytes it touches cannot be counted. Here every read is an explicit ``os.pread`` of
one tensor's byte range (counted in :class:`ByteCounter`), and the writer lays the header
out first (output sizes are known from shapes) and then appends tensors in header order, so
memory holds one tensor at a time and the sha256 is computed on the way (the header layout is
``posttrain.formats.safetensors_header``, shared with every other safetensors writer). The file appears
under its final name only when complete: the writer is a ``posttrain.formats.AtomicFile`` with
the fixed temp name ``<shard>.tmp`` (a resumed run overwrites a killed run's leftover).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.formats import AtomicFile, safetensors_header, tensor_bytes
from posttrain.quant_convert._errors import CheckpointError

__all__ = [
    "DTYPE_BYTES",
    "ByteCounter",
    "HeaderEntry",
    "SafetensorsReader",
    "ShardWriter",
    "read_header",
]

DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "I16": torch.int16, "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "I64": torch.int64,
    "F64": torch.float64,
}  # fmt: skip
_COPY_CHUNK = 8 << 20


class ByteCounter:
    """Thread-safe running total of bytes read from source files."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


@dataclass(slots=True, frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str], bytes]:
    """Entries by name, the ``__metadata__`` dict and the raw header bytes (for fingerprints)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    try:
        header: dict[str, Any] = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header: {exc}") from exc
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    entries = {}
    for name, spec in header.items():
        b, e = spec["data_offsets"]
        entries[name] = HeaderEntry(name, spec["dtype"], tuple(spec["shape"]), base + b, base + e)
    return entries, meta, raw


class SafetensorsReader:
    """Ranged reads of one source file; every byte read is counted."""

    def __init__(self, path: Path, counter: ByteCounter) -> None:
        self.path = path
        self.entries, self.metadata, self.raw_header = read_header(path)
        self._counter = counter
        self._fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_range(self, begin: int, length: int) -> bytearray:
        buf = bytearray(length)
        view = memoryview(buf)
        got = 0
        while got < length:
            n = os.preadv(self._fd, [view[got:]], begin + got)
            if n == 0:
                raise CheckpointError(f"{self.path}: truncated at offset {begin + got}")
            got += n
        self._counter.add(length)
        return buf

    def read_tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        dtype = TORCH_DTYPES.get(e.dtype)
        if dtype is None:
            raise CheckpointError(f"{name}: dtype {e.dtype} is not supported")
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype)
        buf = self.read_range(e.begin, e.nbytes)
        return torch.frombuffer(buf, dtype=dtype).reshape(e.shape)

    def iter_bytes(self, name: str) -> Iterator[bytearray]:
        e = self.entries[name]
        for off in range(e.begin, e.end, _COPY_CHUNK):
            yield self.read_range(off, min(_COPY_CHUNK, e.end - off))


class ShardWriter:
    """Writes one safetensors file in a fixed tensor order; sha256 on the fly; atomic rename."""

    def __init__(
        self,
        path: Path,
        layout: Sequence[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str],
    ) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        head, sizes = safetensors_header(layout, metadata)  # the layout is formats'
        self._order = [(name, n) for (name, _, _), n in zip(layout, sizes, strict=True)]
        self.data_bytes = sum(sizes)
        self._sha = hashlib.sha256()
        self._out = AtomicFile(path, tmp=self.tmp)  # committed in finish(), discarded in abort()
        self._f = self._out.file
        self._emit(head)
        self._next = 0
        self._written_in_current = 0

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        self._f.write(data)
        self._sha.update(data)

    def write(self, name: str, data: bytes | bytearray | memoryview, *, final: bool = True) -> None:
        """Append (part of) tensor ``name``; it must be the next one in the layout."""
        expected, size = self._order[self._next]
        if name != expected:
            raise RuntimeError(f"writer for {self.path}: got {name}, expected {expected}")
        self._emit(data)
        self._written_in_current += len(data)
        if final:
            if self._written_in_current != size:
                raise RuntimeError(
                    f"{name}: wrote {self._written_in_current} bytes, header says {size}"
                )
            self._next += 1
            self._written_in_current = 0

    def write_tensor(self, name: str, t: torch.Tensor) -> None:
        self.write(name, tensor_bytes(t))

    def finish(self) -> str:
        """fsync, rename into place; returns the sha256 of the file."""
        if self._next != len(self._order):
            raise RuntimeError(f"{self.path}: {self._order[self._next][0]} was never written")
        self._out.commit()
        return self._sha.hexdigest()

    def abort(self) -> None:
        self._out.discard()
