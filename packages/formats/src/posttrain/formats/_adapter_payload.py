"""The adapter push payload of ``/load_lora_adapter_from_tensors``, both directions.

``lora-core``'s ``AdapterClient`` writes it and ``local-engine`` reads it; the two bodies:

- JSON, as SGLang-style clients send it: ``{lora_name, config_dict, serialized_tensors,
  load_format: "safetensors_b64", expected_checksums?, upsert?, pinned?}`` with the tensors as
  base64 safetensors (``encode_safetensors_b64``; ``adapter_push_body`` builds the object).
- Raw safetensors bytes whose ``__metadata__`` holds ``lora_name`` and ``config_dict`` (JSON):
  the zero-copy form for large adapters.

Checksums are ``tensor_sha256``: sha256 hex of each tensor's raw C-contiguous bytes in its own
dtype. With ``expected_checksums`` the receiver checks every tensor before anything is loaded
(``verify_adapter_checksums``) and echoes the checksums of what it stored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from posttrain.formats._errors import AdapterPayloadError
from posttrain.formats._safetensors import safetensors_metadata, tensor_bytes

__all__ = [
    "ADAPTER_LOAD_FORMATS",
    "AdapterPayload",
    "adapter_push_body",
    "decode_adapter_payload",
    "encode_safetensors_b64",
    "tensor_sha256",
    "verify_adapter_checksums",
]

ADAPTER_LOAD_FORMATS = ("safetensors_b64",)
"""The ``load_format`` values a receiver decodes (SGLang's CUDA-IPC form is not one)."""


@dataclass(slots=True)
class AdapterPayload:
    """A decoded push: the adapter's name, PEFT config, PEFT-keyed tensors and checksums."""

    name: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    expected_checksums: dict[str, str] = field(default_factory=dict)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's raw bytes (C-contiguous, its own dtype)."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def encode_safetensors_b64(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str | None]:
    """The default serializer: base64 of a safetensors blob, ``load_format="safetensors_b64"``."""
    blob = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    return base64.b64encode(blob).decode("ascii"), "safetensors_b64"


def adapter_push_body(
    name: str,
    config_dict: Mapping[str, Any],
    serialized_tensors: str,
    *,
    load_format: str | None = "safetensors_b64",
    expected_checksums: Mapping[str, str] | None = None,
    upsert: bool = False,
    pinned: bool = False,
) -> dict[str, Any]:
    """The JSON object of a push (``serialized_tensors`` from the caller's serializer)."""
    body: dict[str, Any] = {
        "lora_name": name,
        "config_dict": dict(config_dict),
        "serialized_tensors": serialized_tensors,
        "pinned": pinned,
    }
    if load_format is not None:
        body["load_format"] = load_format
    if expected_checksums:
        body["expected_checksums"] = dict(expected_checksums)
    if upsert:
        body["upsert"] = True
    return body


def _load_safetensors(blob: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(blob)
    except (SafetensorError, ValueError) as exc:
        raise AdapterPayloadError(f"{where}: not a safetensors blob ({exc})", field=where) from None


def decode_adapter_payload(body: bytes, content_type: str) -> AdapterPayload:
    """Decode either body form; raises ``AdapterPayloadError`` naming the bad field."""
    if content_type.split(";")[0].strip().lower() == "application/json":
        return _decode_json(body)
    meta = safetensors_metadata(body, AdapterPayloadError)
    name = meta.get("lora_name")
    if not name:
        raise AdapterPayloadError("__metadata__.lora_name: missing", field="__metadata__.lora_name")
    try:
        config = json.loads(meta.get("config_dict", ""))
    except json.JSONDecodeError:
        raise AdapterPayloadError(
            "__metadata__.config_dict: missing or not JSON (the PEFT adapter config)",
            field="__metadata__.config_dict",
        ) from None
    if not isinstance(config, dict):
        raise AdapterPayloadError(
            "__metadata__.config_dict: not an object", field="__metadata__.config_dict"
        )
    return AdapterPayload(name=name, config=config, tensors=_load_safetensors(body, "body"))


def _decode_json(body: bytes) -> AdapterPayload:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterPayloadError(f"body: invalid JSON ({exc})", field="body") from None
    if not isinstance(data, dict):
        raise AdapterPayloadError("body: expected a JSON object", field="body")
    name = data.get("lora_name")
    if not isinstance(name, str) or not name:
        raise AdapterPayloadError("lora_name: missing or empty", field="lora_name")
    config = data.get("config_dict")
    if not isinstance(config, dict):
        raise AdapterPayloadError("config_dict: missing or not an object", field="config_dict")
    load_format = data.get("load_format", "safetensors_b64")
    if load_format not in ADAPTER_LOAD_FORMATS:
        raise AdapterPayloadError(
            f"load_format: {load_format!r} is not one of {', '.join(ADAPTER_LOAD_FORMATS)}",
            field="load_format",
        )
    payload = data.get("serialized_tensors")
    if not isinstance(payload, str):
        raise AdapterPayloadError(
            "serialized_tensors: missing or not a string", field="serialized_tensors"
        )
    try:
        blob = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise AdapterPayloadError(
            "serialized_tensors: not base64", field="serialized_tensors"
        ) from None
    checksums = data.get("expected_checksums") or {}
    if not isinstance(checksums, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
    ):
        raise AdapterPayloadError(
            "expected_checksums: must map tensor names to sha256 hex strings",
            field="expected_checksums",
        )
    return AdapterPayload(
        name=name,
        config=dict(config),
        tensors=_load_safetensors(blob, "serialized_tensors"),
        expected_checksums=dict(checksums),
    )


def verify_adapter_checksums(payload: AdapterPayload) -> dict[str, str]:
    """The received tensors' checksums; raises if an expected one differs or names no tensor."""
    actual = {name: tensor_sha256(t) for name, t in payload.tensors.items()}
    for name, expected in sorted(payload.expected_checksums.items()):
        where = f"expected_checksums.{name}"
        if name not in actual:
            raise AdapterPayloadError(f"{where}: no such tensor in the payload", field=where)
        if actual[name] != expected:
            raise AdapterPayloadError(
                f"{where}: the received tensor hashes to {actual[name][:12]}..., "
                f"not {expected[:12]}...",
                field=where,
            )
    return actual
