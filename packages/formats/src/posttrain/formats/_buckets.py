"""Buckets of named tensors and the dtype names SGLang's weight-update bodies carry.

``plan_buckets`` is the greedy, in-order split of a tensor list under a byte cap (a tensor larger
than the cap travels alone); each bucket becomes one ``/update_weights_from_distributed`` request
(its ``names``/``dtypes``/``shapes``, ``bucket_request``) and either one broadcast per tensor in
order or, with ``flattened`` (SGLang's ``load_format="flattened_bucket"``), one broadcast of a
``uint8`` tensor holding every tensor's bytes end to end, no padding: the layout SGLang's
``FlattenedTensorBucket.empty`` derives from the names, dtypes and shapes alone, which refuses
a tensor whose start is not a multiple of its item size. ``flat_order`` puts a bucket's wider
items first, which makes every start aligned; ``flat_bytes`` and ``unflatten`` are the two
ends of that layout.
``dtype_name`` / ``dtype_from_name`` map torch dtypes to SGLang's names (``"bfloat16"``: the
receiver does ``getattr(torch, name)``). ``tensors_sha256`` is the engine state digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from posttrain.formats._errors import BucketFormatError
from posttrain.formats._sglang_requests import (
    DEFAULT_GROUP_NAME,
    UpdateWeightsFromDistributedReq,
    version_string,
)

__all__ = [
    "DTYPES",
    "FLATTENED_BUCKET",
    "bucket_request",
    "dtype_from_name",
    "dtype_name",
    "flat_bytes",
    "flat_order",
    "plan_buckets",
    "tensors_sha256",
    "unflatten",
]

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one flat tensor per bucket

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
"""The dtypes a weight update carries, by SGLang's names (``getattr(torch, name)``)."""
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``), or a ``BucketFormatError`` naming
    ``field``."""
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
            f"dtype {dtype} cannot be sent in a weight update (one of {sorted(DTYPES)})",
            field="dtype",
        ) from None


def plan_buckets(
    tensors: Sequence[tuple[str, torch.Tensor]], cap: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split ``tensors`` greedily, in order, into buckets of at most ``cap`` bytes; a tensor
    larger than ``cap`` gets a bucket of its own."""
    if cap <= 0:
        raise BucketFormatError(f"bucket_bytes must be > 0, got {cap}", field="bucket_bytes")
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if out[-1] and used + n > cap:
            out.append([])
            used = 0
        out[-1].append((name, t))
        used += n
    return [b for b in out if b]


def bucket_request(
    bucket: Sequence[tuple[str, torch.Tensor]],
    *,
    last: bool,
    weight_version: int | None,
    group_name: str = DEFAULT_GROUP_NAME,
    flattened: bool = False,
) -> UpdateWeightsFromDistributedReq:
    """The ``/update_weights_from_distributed`` body of one bucket. Only the last bucket of an
    update flushes the cache and carries the new ``weight_version`` (the update's end).
    ``flattened``: the bucket travels as one broadcast (``flat_bytes``; put it in
    ``flat_order`` first)."""
    return UpdateWeightsFromDistributedReq(
        names=[n for n, _ in bucket],
        dtypes=[dtype_name(t.dtype) for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
        group_name=group_name,
        flush_cache=last,
        weight_version=version_string(weight_version) if last else None,
        load_format=FLATTENED_BUCKET if flattened else None,
    )


def flat_order(
    bucket: Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """``bucket`` with wider items first (stable): packed end to end, every tensor then starts
    at a multiple of its item size (item sizes are powers of two, and each tensor's bytes are a
    multiple of its own), as SGLang's flattened receive requires."""
    return sorted(bucket, key=lambda item: -item[1].element_size())


def flat_bytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One ``uint8`` tensor of the bucket's bytes end to end, in its order (on its tensors'
    device); refuses a bucket whose layout would misalign a tensor (``flat_order`` first)."""
    _starts([(n, t.dtype, t.shape) for n, t in bucket])
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _starts(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
) -> tuple[list[int], int]:
    """Each entry's byte offset in the flat layout and the total; an entry that would start
    off its item size's grid is refused by name (SGLang refuses it too)."""
    starts: list[int] = []
    at = 0
    for name, dtype, shape in entries:
        size = dtype.itemsize
        if at % size:
            raise BucketFormatError(
                f"{name}: starts at byte {at} of a flattened bucket, not a multiple of its "
                f"{dtype} item size {size} (send wider items first)",
                field="names",
            )
        starts.append(at)
        at += torch.Size(shape).numel() * size
    return starts, at


def unflatten(
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    flat: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The receiving end: each tensor of a received flat ``uint8`` buffer as a view of it, by
    name (the layout checked as SGLang checks it)."""
    starts, total = _starts(list(zip(names, dtypes, shapes, strict=True)))
    if flat.dtype != torch.uint8 or flat.numel() != total:
        raise BucketFormatError(
            f"flattened bucket: {flat.numel()} {flat.dtype} elements for {total} bytes of tensors",
            field="shapes",
        )
    return {
        name: flat[at : at + torch.Size(shape).numel() * d.itemsize].view(d).view(tuple(shape))
        for name, d, shape, at in zip(names, dtypes, shapes, starts, strict=True)
    }


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """A sha256 over names, dtypes, shapes and bytes in sorted name order (engine state hash)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
