"""TEMPORARY stand-ins for interface wire types that have not landed on main yet."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class TensorEntry(BaseModel):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class BucketManifest(BaseModel):
    protocol: Literal["wsync/1"] = "wsync/1"
    update_id: str
    weight_version: str
    kind: Literal["base", "lora"] = "base"
    bucket_index: int
    is_last: bool
    alignment: int = 256
    total_bytes: int
    tensors: list[TensorEntry]
    sha256: str | None = None


class ExpectedTensor(BaseModel):
    name: str
    dtype: str
    shape: list[int]


class WeightUpdateBegin(BaseModel):
    update_id: str
    weight_version: str
    kind: Literal["base", "lora"] = "base"
    expected: list[ExpectedTensor] = Field(default_factory=list)
    lora_name: str | None = None


class WeightUpdateResult(BaseModel):
    success: bool
    weight_version: str | None = None
    missing: list[str] = Field(default_factory=list)
    unexpected: list[str] = Field(default_factory=list)
    duplicates: list[str] = Field(default_factory=list)
    message: str = ""
