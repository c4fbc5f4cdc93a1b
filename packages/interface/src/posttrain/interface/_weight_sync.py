"""The weight-sync wire protocol ``wsync/1``: a session of aligned tensor buckets.

A trainer opens an update with ``WeightUpdateBegin`` (the full list of tensors
it will send), ships buckets each described by a ``BucketManifest`` (tensors
packed at 256-byte aligned offsets of one byte buffer, so one buffer can hold
mixed dtypes), and closes with ``end``; the engine answers a
``WeightUpdateResult``. Over shared memory a bucket's bytes lie in a ring slot that
``ShmBucketRequest`` names. The version moves only when every expected tensor
arrived exactly once; anything else leaves the engine refusing to generate
until a complete update succeeds.
"""

from __future__ import annotations

import math
from typing import Literal

import pydantic

from posttrain.interface._wire_base import (
    NonNegativeInt,
    PositiveInt,
    StrictBool,
    WireModel,
)

WIRE_DTYPES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Dtypes a bucket may carry, with their item sizes in bytes (torch's names)."""

WireDtype = Literal[
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "uint8",
    "int8",
    "int32",
    "int64",
    "bool",
]

BUCKET_ALIGNMENT = 256


class ExpectedTensor(WireModel):
    """A tensor an update promises to send."""

    name: str = pydantic.Field(min_length=1)
    dtype: WireDtype
    shape: tuple[NonNegativeInt, ...]


class TensorEntry(WireModel):
    """Where one tensor lies in a bucket's byte buffer."""

    name: str = pydantic.Field(min_length=1)
    dtype: WireDtype
    shape: tuple[NonNegativeInt, ...]
    offset: NonNegativeInt
    nbytes: NonNegativeInt

    @pydantic.model_validator(mode="after")
    def _check_size(self) -> TensorEntry:
        expected = math.prod(self.shape) * WIRE_DTYPES[self.dtype]
        if self.nbytes != expected:
            raise ValueError(
                f"tensor {self.name!r}: nbytes {self.nbytes} != {expected} for shape "
                f"{list(self.shape)} of {self.dtype}"
            )
        return self

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class BucketManifest(WireModel):
    """One bucket of a weight update: its tensors, their aligned offsets and the buffer size."""

    protocol: Literal["wsync/1"] = "wsync/1"
    update_id: str = pydantic.Field(min_length=1)
    weight_version: NonNegativeInt
    kind: Literal["base", "lora"]
    bucket_index: NonNegativeInt
    is_last: StrictBool
    alignment: PositiveInt = BUCKET_ALIGNMENT
    total_bytes: NonNegativeInt
    tensors: list[TensorEntry]
    sha256: str | None = pydantic.Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @pydantic.model_validator(mode="after")
    def _check_layout(self) -> BucketManifest:
        seen: set[str] = set()
        previous_end = 0
        for entry in self.tensors:
            if entry.name in seen:
                raise ValueError(
                    f"tensor {entry.name!r} appears twice in bucket {self.bucket_index}"
                )
            seen.add(entry.name)
            if entry.offset % self.alignment:
                raise ValueError(
                    f"tensor {entry.name!r}: offset {entry.offset} is not a multiple of "
                    f"alignment {self.alignment}"
                )
            if entry.offset < previous_end:
                raise ValueError(
                    f"tensor {entry.name!r}: offset {entry.offset} overlaps the previous tensor "
                    f"(which ends at {previous_end})"
                )
            previous_end = entry.end
        if previous_end > self.total_bytes:
            raise ValueError(
                f"tensors end at byte {previous_end} but total_bytes is {self.total_bytes}"
            )
        return self


class WeightUpdateBegin(WireModel):
    """Opens an update: the version it will install and every tensor it will send."""

    protocol: Literal["wsync/1"] = "wsync/1"
    update_id: str = pydantic.Field(min_length=1)
    weight_version: NonNegativeInt
    kind: Literal["base", "lora"]
    expected: list[ExpectedTensor]
    lora_name: str | None = None
    lora_config: dict[str, object] | None = None

    @pydantic.model_validator(mode="after")
    def _check(self) -> WeightUpdateBegin:
        names = [t.name for t in self.expected]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"expected lists tensor(s) twice: {dup}")
        if self.kind == "lora" and not self.lora_name:
            raise ValueError("a lora update needs lora_name")
        return self


class ShmBucketRequest(WireModel):
    """``POST /update_weights_from_shm``: a bucket packed in slot ``slot`` of a shared-memory ring.

    The ring is one file of equal slots (``slot_bytes`` each; by default two, so half the file).
    """

    manifest: BucketManifest
    shm_path: str = pydantic.Field(min_length=1)
    slot: NonNegativeInt
    slot_bytes: PositiveInt | None = None


class WeightUpdateResult(WireModel):
    """How an update ended; ``success`` only if every expected tensor arrived exactly once."""

    success: StrictBool
    weight_version: NonNegativeInt | None = None
    missing: list[str] = pydantic.Field(default_factory=list)
    unexpected: list[str] = pydantic.Field(default_factory=list)
    duplicates: list[str] = pydantic.Field(default_factory=list)
    message: str = ""
