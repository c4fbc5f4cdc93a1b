"""Header-only safetensors reading, ranged tensor reads, and a streaming atomic shard writer.

Why not ``safetensors.safe_open``: it maps the whole file, so its pages count towards RSS
and the bytes it touches cannot be counted. Here every read is an explicit ``os.pread`` of
one tensor's byte range (counted in :class:`ByteCounter`), and the writer lays the header
out first (output sizes are known from shapes) and then appends tensors in header order, so
memory holds one tensor at a time and the sha256 is computed on the way (the header layout is
``posttrain.formats.safetensors_header``, shared with every other safetensors writer). The file appears
under its final name only when complete: the writer is a ``posttrain.formats.AtomicFile`` with
the fixed temp name ``<shard>.tmp`` (a resumed run overwrites a killed run's leftover).

Headers are untrusted bytes and are parsed defensively (``parse_header``): the declared
length must fit the file and a 100 MB cap (safetensors' own) before anything is read, the
JSON must be an object whose ``__metadata__`` maps strings to strings and whose every
entry has a known ``dtype``, a ``shape`` of non-negative ints and ``data_offsets`` inside
the data section, agreeing with dtype x shape and overlapping no other tensor. Every
failure is a ``CheckpointError`` naming the file and tensor; every OS error while reading
a source is one too, and while writing the destination an ``OutputError``: the writer
removes its ``*.tmp`` file, so nothing half-written stays behind.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.formats import SAFETENSORS_DTYPES, AtomicFile, safetensors_header, tensor_bytes
from posttrain.formats import write_bytes_atomic as _write_bytes_atomic
from posttrain.quant_convert._errors import CheckpointError, OutputError, ResumeError

__all__ = [
    "DTYPE_BYTES",
    "ByteCounter",
    "HeaderEntry",
    "SafetensorsReader",
    "ShardWriter",
    "parse_header",
    "read_header",
    "read_json_object",
    "write_bytes_atomic",
]

# The safetensors dtype names, from formats' one table (torch dtype -> name).
TORCH_DTYPES: dict[str, torch.dtype] = {name: dt for dt, name in SAFETENSORS_DTYPES.items()}
DTYPE_BYTES: dict[str, int] = {
    name: torch.empty((), dtype=dt).element_size() for name, dt in TORCH_DTYPES.items()
}
_COPY_CHUNK = 8 << 20
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors refuses larger headers too


def output_error(exc: OSError, path: Path, doing: str) -> OutputError:
    """An OS error while writing the destination, as a named error (errno and reason)."""
    reason = exc.strerror or str(exc)
    return OutputError(f"cannot {doing} {path}: {reason} (errno {exc.errno})")


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


def read_json_object(path: Path, error: type[CheckpointError | ResumeError]) -> dict[str, Any]:
    """A JSON object from ``path``; unreadable, malformed or not an object is ``error``."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (ValueError, RecursionError) as exc:
        raise error(f"{path}: not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a JSON {type(data).__name__}, not an object")
    return data


def _bad(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a valid safetensors file: {why}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_header(
    raw: bytes, data_bytes: int, path: Path
) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Validate a header's JSON against a data section of ``data_bytes`` (see the docstring)."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _bad(path, f"header is not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    base = 8 + len(raw)
    entries: dict[str, HeaderEntry] = {}
    for name, spec in header.items():
        where = f"tensor {name!r}"
        if not isinstance(spec, dict):
            raise _bad(path, f"{where}: entry is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise _bad(path, f"{where}: dtype {dtype!r} is missing or not supported")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _bad(path, f"{where}: shape {shape!r} is not a list of non-negative ints")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise _bad(
                path, f"{where}: data_offsets {offsets!r} are not [begin, end] in [0, {data_bytes}]"
            )
        nbytes = DTYPE_BYTES[dtype] * math.prod(shape)
        if offsets[1] - offsets[0] != nbytes:
            raise _bad(
                path,
                f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, {dtype} {shape} "
                f"needs {nbytes}",
            )
        entries[name] = HeaderEntry(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise _bad(path, f"tensors {first!r} and {second!r} overlap")
    return entries, meta


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str], bytes]:
    """Entries by name, the ``__metadata__`` dict and the raw header bytes (for fingerprints).

    The length prefix is checked against the file size before the header is read, so a
    corrupt prefix (2^40) costs nothing.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise _bad(
                    path,
                    f"header length {n} exceeds the file ({size} bytes) or the "
                    f"{MAX_HEADER_BYTES}-byte limit",
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    entries, meta = parse_header(raw, size - 8 - n, path)
    return entries, meta, raw


class SafetensorsReader:
    """Ranged reads of one source file; every byte read is counted."""

    def __init__(self, path: Path, counter: ByteCounter) -> None:
        self.path = path
        self.entries, self.metadata, self.raw_header = read_header(path)
        self._counter = counter
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot open ({exc.strerror or exc})") from exc

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
            try:
                n = os.preadv(self._fd, [view[got:]], begin + got)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: read failed ({exc.strerror or exc})") from exc
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
        try:  # committed in finish(), discarded in abort()
            self._out = AtomicFile(path, tmp=self.tmp)
        except OSError as exc:
            raise output_error(exc, self.tmp, "create") from exc
        self._f = self._out.file
        self._emit(head)
        self._next = 0
        self._written_in_current = 0

    def _emit(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._f.write(data)
        except OSError as exc:  # a full disk (ENOSPC), a quota, a vanished mount
            raise output_error(exc, self.tmp, "write") from exc
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
        try:
            self._out.commit()
        except OSError as exc:  # commit already removed the temp file
            raise output_error(exc, self.path, "finish") from exc
        return self._sha.hexdigest()

    def abort(self) -> None:
        """Close and remove the temporary file (also when closing fails: the disk may be full)."""
        self._out.discard()


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """A small destination file, atomically (``posttrain.formats``); OS errors as ``OutputError``.

    The temp name is fixed (``<name>.tmp``): a rerun after a kill overwrites the leftover
    instead of adding one.
    """
    try:
        _write_bytes_atomic(path, data, tmp=path.with_name(path.name + ".tmp"))
    except OSError as exc:
        raise output_error(exc, path, "write") from exc
