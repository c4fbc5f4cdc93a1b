"""SGLang's weight-update request bodies, as SGLang 0.5.x's ``io_struct`` declares them.

One home for both directions: the trainer builds these (``to_dict()`` is the JSON it posts) and
posttrain's local engine parses them (``parse``: unknown keys and wrong types refused, the bad
field named). The field names, defaults and types follow SGLang's request classes (checked by
``integration_tests/test_integration_sglang_conformance.py`` against the pinned wheel):

- ``InitWeightsUpdateGroupReqInput`` (``/init_weights_update_group``): the trainer's rank 0 is
  rank 0 of a ``torch.distributed`` group at ``master_address:master_port``; each engine's TP
  workers take ranks ``rank_offset ...``; ``backend`` nccl on GPU, gloo on CPU.
- ``UpdateWeightsFromDistributedReqInput`` (``/update_weights_from_distributed``): one bucket's
  ``names``/``dtypes``/``shapes`` while group rank 0 broadcasts the tensors in that order.
- ``DestroyWeightsUpdateGroupReqInput`` (``/destroy_weights_update_group``).
- ``UpdateWeightsFromTensorReqInput`` (``/update_weights_from_tensor``): per-TP-rank serialized
  named tensors (colocated engines: CUDA IPC handles).
- ``UpdateWeightFromDiskReqInput`` (``/update_weights_from_disk``; interface's
  ``UpdateWeightsFromDiskRequest`` is the engine's reading of it).
- ``LoadLoRAAdapterReqInput`` / ``LoadLoRAAdapterFromTensorsReqInput`` (per-TP-rank
  ``serialized_named_tensors``, base64 over HTTP) and ``UpdateWeightVersionReqInput``.

``weight_version`` travels as SGLang's string (posttrain's int versions, written in decimal).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

import pydantic

from posttrain.interface import WireModel

__all__ = [
    "DEFAULT_GROUP_NAME",
    "DestroyWeightsUpdateGroupReq",
    "InitWeightsUpdateGroupReq",
    "LoadLoraAdapterFromTensorsReq",
    "LoadLoraAdapterReq",
    "UpdateWeightFromDiskReq",
    "UpdateWeightVersionReq",
    "UpdateWeightsFromDistributedReq",
    "UpdateWeightsFromTensorReq",
    "version_string",
]

DEFAULT_GROUP_NAME = "weight_update_group"
"""SGLang's default ``group_name``."""


def version_string(version: int | None) -> str | None:
    """A posttrain weight version as SGLang's ``weight_version`` string."""
    return None if version is None else str(int(version))


def _b64_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise ValueError("expected a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64") from None


B64Bytes = Annotated[
    bytes,
    pydantic.BeforeValidator(_b64_bytes),
    pydantic.PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str),
]
"""Bytes that JSON carries as base64 (SGLang's ``Base64Bytes``)."""

StrictBool = pydantic.StrictBool
NonNegativeInt = Annotated[int, pydantic.Strict(), pydantic.Field(ge=0)]
PositiveInt = Annotated[int, pydantic.Strict(), pydantic.Field(ge=1)]
Shape = list[NonNegativeInt]


class InitWeightsUpdateGroupReq(WireModel):
    """``POST /init_weights_update_group``."""

    master_address: str = pydantic.Field(min_length=1)
    master_port: Annotated[int, pydantic.Strict(), pydantic.Field(ge=1, le=65535)]
    rank_offset: PositiveInt
    world_size: Annotated[int, pydantic.Strict(), pydantic.Field(ge=2)]
    group_name: str = pydantic.Field(default=DEFAULT_GROUP_NAME, min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedReq(WireModel):
    """``POST /update_weights_from_distributed``: one bucket, broadcast from group rank 0."""

    names: list[str]
    dtypes: list[str]
    shapes: list[Shape]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = None
    load_format: str | None = None

    @pydantic.model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedReq:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes differ in length ({len(self.names)}, "
                f"{len(self.dtypes)}, {len(self.shapes)})"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError("names: a tensor is named twice")
        return self


class DestroyWeightsUpdateGroupReq(WireModel):
    """``POST /destroy_weights_update_group``."""

    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeightsFromTensorReq(WireModel):
    """``POST /update_weights_from_tensor`` (colocated engines; one payload per TP rank)."""

    serialized_named_tensors: list[B64Bytes] = pydantic.Field(min_length=1)
    load_format: str | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: str | None = None


class UpdateWeightFromDiskReq(WireModel):
    """``POST /update_weights_from_disk``, as the trainer sends it."""

    model_path: str = pydantic.Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: StrictBool = False
    weight_version: str | None = None
    flush_cache: StrictBool = True


class LoadLoraAdapterReq(WireModel):
    """``POST /load_lora_adapter``: a PEFT directory the engine reads."""

    lora_name: str = pydantic.Field(min_length=1)
    lora_path: str = pydantic.Field(min_length=1)
    pinned: StrictBool = False


class LoadLoraAdapterFromTensorsReq(WireModel):
    """``POST /load_lora_adapter_from_tensors``: one serialized copy per TP rank."""

    lora_name: str = pydantic.Field(min_length=1)
    config_dict: dict[str, Any]
    serialized_named_tensors: list[B64Bytes] = pydantic.Field(min_length=1)
    pinned: StrictBool = False
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class UpdateWeightVersionReq(WireModel):
    """``POST /update_weight_version``."""

    new_version: str = pydantic.Field(min_length=1)
    abort_all_requests: StrictBool = True
