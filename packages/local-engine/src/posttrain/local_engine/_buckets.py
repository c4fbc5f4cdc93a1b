"""Flat weight buckets: named tensors <-> one aligned byte buffer described by a manifest.

A bucket is one contiguous buffer holding several tensors of possibly different
dtypes, each starting at an offset that is a multiple of ``alignment`` (256 by
default), so a single buffer carries bf16 and fp32 tensors side by side (SGLang's
FlattenedTensorBucket cannot: it is single-dtype). The manifest lists
``(name, dtype, shape, offset, nbytes)`` per tensor, ``total_bytes`` and an
optional sha256 over ``buffer[:total_bytes]``. Unpacking makes zero-copy views
into the buffer; callers that keep the tensors past the buffer's life copy them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from posttrain.interface import BucketManifest, TensorEntry, WireFormatError

__all__ = [
    "DTYPES",
    "dtype_from_name",
    "dtype_name",
    "pack_bucket",
    "tensors_sha256",
    "unpack_bucket",
]

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
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``), or a WireFormatError naming ``field``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise WireFormatError(
            f"{field}: unsupported dtype {name!r}; expected one of {sorted(DTYPES)}", field=field
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise WireFormatError(
            f"dtype {dtype} cannot be sent over the wire", field="dtype"
        ) from None


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def pack_bucket(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    update_id: str,
    weight_version: int,
    kind: Literal["base", "lora"] = "base",
    bucket_index: int = 0,
    is_last: bool = True,
    alignment: int = 256,
    with_sha256: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[BucketManifest, torch.Tensor]:
    """Pack named tensors into one uint8 buffer (``out`` when given, else a new one).

    Returns the manifest and the buffer sliced to ``total_bytes``.
    """
    items = list(tensors)
    entries: list[TensorEntry] = []
    offset = 0
    for name, t in items:
        offset = _align(offset, alignment)
        nbytes = t.numel() * t.element_size()
        entries.append(
            TensorEntry(
                name=name,
                dtype=dtype_name(t.dtype),  # type: ignore[arg-type]
                shape=tuple(t.shape),
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset += nbytes
    total = offset
    if out is None:
        buf = torch.zeros(total, dtype=torch.uint8)
    else:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
            raise WireFormatError(
                f"out: bucket needs {total} bytes, the buffer has {out.numel()}", field="out"
            )
        buf = out[:total]
        previous_end = 0
        for e in entries:  # zero the alignment gaps so the digest is reproducible
            buf[previous_end : e.offset].zero_()
            previous_end = e.offset + e.nbytes
    for (_, t), e in zip(items, entries, strict=True):
        if e.nbytes:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[e.offset : e.offset + e.nbytes].copy_(src)
    sha = hashlib.sha256(buf.numpy().data).hexdigest() if with_sha256 else None
    manifest = BucketManifest(
        update_id=update_id,
        weight_version=weight_version,
        kind=kind,
        bucket_index=bucket_index,
        is_last=is_last,
        alignment=alignment,
        total_bytes=total,
        tensors=entries,
        sha256=sha,
    )
    return manifest, buf


def unpack_bucket(manifest: BucketManifest, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy views of the manifest's tensors in ``buf`` (uint8, at least total_bytes long).

    Checks bounds, alignment, byte counts and the sha256 when the manifest has one; raises
    WireFormatError naming the tensor at fault. Duplicate names are reported by the caller
    (an update session), so this returns the last one and leaves the count to it.
    """
    if buf.numel() < manifest.total_bytes:
        raise WireFormatError(
            f"manifest.total_bytes: {manifest.total_bytes} exceeds the {buf.numel()}-byte buffer",
            field="manifest.total_bytes",
        )
    if manifest.sha256 is not None:
        digest = hashlib.sha256(buf[: manifest.total_bytes].numpy().data).hexdigest()
        if digest != manifest.sha256:
            raise WireFormatError(
                f"manifest.sha256: bucket {manifest.bucket_index} of update "
                f"{manifest.update_id!r} hashes to {digest}, manifest says {manifest.sha256}",
                field="manifest.sha256",
            )
    out: dict[str, torch.Tensor] = {}
    for i, e in enumerate(manifest.tensors):
        field = f"manifest.tensors[{i}]"
        dtype = dtype_from_name(e.dtype, field=f"{field}.dtype")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(e.shape)
        if e.nbytes != numel * itemsize:
            raise WireFormatError(
                f"{field}: tensor {e.name!r} of shape {list(e.shape)} {e.dtype} needs "
                f"{numel * itemsize} bytes, manifest says {e.nbytes}",
                field=f"{field}.nbytes",
            )
        if e.offset % manifest.alignment or e.offset < 0:
            raise WireFormatError(
                f"{field}: tensor {e.name!r} offset {e.offset} is not a multiple of "
                f"{manifest.alignment}",
                field=f"{field}.offset",
            )
        if e.offset + e.nbytes > manifest.total_bytes:
            raise WireFormatError(
                f"{field}: tensor {e.name!r} ends at {e.offset + e.nbytes}, past total_bytes "
                f"{manifest.total_bytes}",
                field=f"{field}.offset",
            )
        raw = buf[e.offset : e.offset + e.nbytes]
        if (raw.storage_offset() % itemsize) and numel:
            raw = raw.clone()  # an alignment below the item size: views need aligned storage
        out[e.name] = (
            raw.view(dtype).reshape(e.shape) if numel else torch.empty(e.shape, dtype=dtype)
        )
    return out


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """A sha256 over names, dtypes, shapes and bytes in sorted name order (engine state hash)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
