"""wsync/1 buckets: named tensors <-> one 256-byte aligned byte buffer described by a manifest.

A bucket is one contiguous buffer holding several tensors of possibly different dtypes, each
starting at an offset that is a multiple of ``alignment`` (256 by default), so one buffer
carries bf16 and fp32 tensors side by side (SGLang's FlattenedTensorBucket cannot: it is
single-dtype). The ``BucketManifest`` lists ``(name, dtype, shape, offset, nbytes)`` per tensor,
``total_bytes`` and an optional sha256 over ``buffer[:total_bytes]``; alignment gaps are zero,
so the digest is reproducible. Unpacking makes zero-copy views into the buffer; callers that
keep the tensors past the buffer's life copy them.

Over HTTP a bucket travels as a safetensors file whose ``__metadata__["manifest"]`` is the
manifest's JSON (safetensors metadata values are strings; safetensors has no alignment gaps, so
the offsets describe the packed layout and matter for the sha256, which the reader checks by
rebuilding that layout). ``encode_bucket_body`` / ``decode_bucket_body`` are its two directions.

``plan_buckets`` is the greedy, in-order split of a tensor list under a byte cap; a tensor larger
than the cap travels alone in its own bucket.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from posttrain.formats._errors import BucketFormatError
from posttrain.formats._safetensors import safetensors_metadata
from posttrain.interface import (
    BUCKET_ALIGNMENT,
    WIRE_DTYPES,
    BucketManifest,
    ExpectedTensor,
    TensorEntry,
    WireFormatError,
)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
"""The wire dtypes of wsync/1 (the interface's ``WIRE_DTYPES``) as torch dtypes."""
_NAMES = {v: k for k, v in DTYPES.items()}
MANIFEST_KEY = "manifest"


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``), or a ``BucketFormatError`` naming ``field``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise BucketFormatError(
            f"{field}: unsupported dtype {name!r}; expected one of {sorted(DTYPES)}", field=field
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise BucketFormatError(
            f"dtype {dtype} cannot be sent over the wire (wsync/1 carries {sorted(DTYPES)})",
            field="dtype",
        ) from None


def aligned(n: int, alignment: int = BUCKET_ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def expected_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[ExpectedTensor]:
    """The ``expected`` list of a ``WeightUpdateBegin`` for these named tensors."""
    return [
        ExpectedTensor(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape))  # type: ignore[arg-type]
        for name, t in tensors
    ]


def bucket_layout(
    tensors: Sequence[tuple[str, torch.Tensor]], alignment: int = BUCKET_ALIGNMENT
) -> tuple[list[TensorEntry], int]:
    """Each tensor's aligned entry in a packed bucket, and the bucket's ``total_bytes``."""
    entries: list[TensorEntry] = []
    offset = 0
    for name, t in tensors:
        offset = aligned(offset, alignment)
        entries.append(
            TensorEntry(
                name=name,
                dtype=dtype_name(t.dtype),  # type: ignore[arg-type]
                shape=tuple(t.shape),
                offset=offset,
                nbytes=_nbytes(t),
            )
        )
        offset += _nbytes(t)
    return entries, offset


def plan_buckets(
    tensors: Sequence[tuple[str, torch.Tensor]],
    cap: int,
    alignment: int = BUCKET_ALIGNMENT,
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split ``tensors`` greedily, in order, into buckets of at most ``cap`` packed bytes.

    A tensor larger than ``cap`` gets a bucket of its own.
    """
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in tensors:
        start = aligned(used, alignment)
        if out[-1] and start + _nbytes(t) > cap:
            out.append([])
            start = 0
        out[-1].append((name, t))
        used = start + _nbytes(t)
    return [b for b in out if b]


def _digest(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.numpy().data).hexdigest()


def pack_bucket(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    update_id: str,
    weight_version: int,
    kind: Literal["base", "lora"] = "base",
    bucket_index: int = 0,
    is_last: bool = True,
    alignment: int = BUCKET_ALIGNMENT,
    with_sha256: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[BucketManifest, torch.Tensor]:
    """Pack named tensors into one uint8 buffer (``out`` when given, else a new one).

    Returns the manifest and the buffer sliced to ``total_bytes``.
    """
    items = list(tensors)
    entries, total = bucket_layout(items, alignment)
    if out is None:
        buf = torch.zeros(total, dtype=torch.uint8)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
            raise BucketFormatError(
                f"out: the bucket needs {total} bytes of a 1-D uint8 buffer, got "
                f"{out.dtype} {list(out.shape)}",
                field="out",
            )
        buf = out[:total]
        previous_end = 0
        for e in entries:  # zero the alignment gaps so the digest is reproducible
            buf[previous_end : e.offset].zero_()
            previous_end = e.end
    for (_, t), e in zip(items, entries, strict=True):
        if e.nbytes:
            buf[e.offset : e.end].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    manifest = BucketManifest(
        update_id=update_id,
        weight_version=weight_version,
        kind=kind,
        bucket_index=bucket_index,
        is_last=is_last,
        alignment=alignment,
        total_bytes=total,
        tensors=entries,
        sha256=_digest(buf) if with_sha256 else None,
    )
    return manifest, buf


def as_byte_tensor(payload: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over ``payload`` (no copy unless the buffer is read-only)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise BucketFormatError(
                f"payload: expected a 1-D uint8 tensor, got {payload.dtype} {list(payload.shape)}",
                field="payload",
            )
        return payload
    view = memoryview(payload).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        view = memoryview(bytearray(view))  # torch.frombuffer wants writable memory
    return torch.frombuffer(view, dtype=torch.uint8)


def _bucket_buffer(
    manifest: BucketManifest, payload: bytes | bytearray | memoryview | torch.Tensor
) -> torch.Tensor:
    buf = as_byte_tensor(payload)
    if buf.numel() < manifest.total_bytes:
        raise BucketFormatError(
            f"manifest.total_bytes: {manifest.total_bytes} exceeds the {buf.numel()}-byte buffer",
            field="manifest.total_bytes",
        )
    return buf


def unpack_bucket(
    manifest: BucketManifest, payload: bytes | bytearray | memoryview | torch.Tensor
) -> dict[str, torch.Tensor]:
    """Zero-copy views of the manifest's tensors in ``payload`` (at least total_bytes long).

    Checks that the buffer holds ``total_bytes`` and, when the manifest has one, the sha256;
    raises ``BucketFormatError`` naming the field at fault. What the manifest says of its own
    layout (each tensor's byte count, aligned and non-overlapping offsets inside
    ``total_bytes``, no name twice) its validators already refused when it was built.
    """
    buf = _bucket_buffer(manifest, payload)
    _check_digest(manifest, buf)
    return _views(manifest, buf)


def _check_digest(manifest: BucketManifest, buf: torch.Tensor) -> None:
    """Refuse ``buf`` (at least ``total_bytes`` long) when it disagrees with the manifest's sha256."""
    if manifest.sha256 is None:
        return
    digest = _digest(buf[: manifest.total_bytes])
    if digest != manifest.sha256:
        raise BucketFormatError(
            f"manifest.sha256: bucket {manifest.bucket_index} of update "
            f"{manifest.update_id!r} hashes to {digest}, manifest says {manifest.sha256}",
            field="manifest.sha256",
        )


def _views(manifest: BucketManifest, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The manifest's tensors as views of ``buf`` (checked to hold ``total_bytes``)."""
    out: dict[str, torch.Tensor] = {}
    for e in manifest.tensors:
        dtype, itemsize = DTYPES[e.dtype], WIRE_DTYPES[e.dtype]
        if not e.nbytes:
            out[e.name] = torch.empty(e.shape, dtype=dtype)
            continue
        raw = buf[e.offset : e.end]
        if raw.storage_offset() % itemsize:
            raw = raw.clone()  # an alignment below the item size: views need aligned storage
        out[e.name] = raw.view(dtype).reshape(e.shape)
    return out


def encode_bucket_body(
    manifest: BucketManifest, payload: bytes | bytearray | memoryview | torch.Tensor
) -> bytes:
    """The HTTP body of a bucket: a safetensors file of its tensors, the manifest in metadata.

    The payload is not hashed again here (``pack_bucket`` just did, and the receiver checks the
    digest on the bytes it got); only its length is checked.
    """
    buf = _bucket_buffer(manifest, payload)
    tensors = _views(manifest, buf)
    return bytes(st_save(tensors, metadata={MANIFEST_KEY: manifest.to_json()}))


def bucket_body_manifest(body: bytes) -> BucketManifest:
    """The manifest a bucket's HTTP body carries, read from its safetensors header alone.

    A receiver reads it first to know which update a body belongs to, so that a body whose
    tensors then fail to decode refuses that update (``decode_bucket_body`` checks them).
    """
    meta = safetensors_metadata(body, BucketFormatError)
    if MANIFEST_KEY not in meta:
        raise BucketFormatError(
            "__metadata__.manifest: missing (the bucket manifest as JSON)",
            field="__metadata__.manifest",
        )
    try:
        return BucketManifest.from_json(meta[MANIFEST_KEY])
    except WireFormatError as e:
        raise BucketFormatError(f"__metadata__.manifest: {e}", field=e.field) from e


def decode_bucket_body(body: bytes) -> tuple[BucketManifest, dict[str, torch.Tensor]]:
    """Decode a bucket sent as safetensors bytes; check its tensors against its manifest."""
    manifest = bucket_body_manifest(body)
    try:
        tensors: dict[str, Any] = st_load(body)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise BucketFormatError(f"body: not a valid safetensors file ({e})", field="body") from e
    names = [entry.name for entry in manifest.tensors]
    extra = sorted(set(tensors) - set(names))
    absent = sorted(set(names) - set(tensors))
    if extra or absent:
        raise BucketFormatError(
            f"body: tensors {extra} are not in the manifest, manifest tensors {absent} are not "
            "in the body",
            field="manifest.tensors",
        )
    for i, entry in enumerate(manifest.tensors):
        t = tensors[entry.name]
        got = _NAMES.get(t.dtype, str(t.dtype))
        if got != entry.dtype or tuple(t.shape) != tuple(entry.shape):
            raise BucketFormatError(
                f"manifest.tensors[{i}]: tensor {entry.name!r} is {got} {list(t.shape)} in the "
                f"body, {entry.dtype} {list(entry.shape)} in the manifest",
                field=f"manifest.tensors[{i}]",
            )
    if manifest.sha256 is not None:
        # The packed size is the tensors' bytes plus alignment gaps, so a manifest claiming
        # more cannot make this allocate more than the body holds.
        packed = sum(e.nbytes for e in manifest.tensors) + manifest.alignment * len(names)
        if manifest.total_bytes > packed:
            raise BucketFormatError(
                f"manifest.total_bytes: {manifest.total_bytes} exceeds what its tensors pack to "
                f"({packed} bytes at most)",
                field="manifest.total_bytes",
            )
        flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
        for entry in manifest.tensors:
            if entry.nbytes:
                src = tensors[entry.name].contiguous().reshape(-1).view(torch.uint8)
                flat[entry.offset : entry.end].copy_(src)
        _check_digest(manifest, flat)
    return manifest, tensors


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """A sha256 over names, dtypes, shapes and bytes in sorted name order (engine state hash)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
