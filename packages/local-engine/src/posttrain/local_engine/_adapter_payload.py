"""The two bodies ``/load_lora_adapter_from_tensors`` accepts, decoded to PEFT tensors.

- Raw safetensors bytes whose ``__metadata__`` holds ``lora_name`` and ``config_dict``
  (JSON): the zero-copy form for large adapters.
- JSON, as ``posttrain.lora.AdapterClient`` (and SGLang-style clients) send it:
  ``{lora_name, config_dict, serialized_tensors, load_format: "safetensors_b64",
  expected_checksums?, upsert?, pinned?}`` with the tensors as base64 safetensors.

With ``expected_checksums`` (tensor name -> sha256 hex of its raw C-contiguous
bytes) every received tensor is checked before anything is loaded, and the
reply echoes the checksums of what was stored, so a client can verify a push.
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

from posttrain.formats import safetensors_metadata
from posttrain.interface import WireFormatError

SUPPORTED_LOAD_FORMATS = ("safetensors_b64",)


@dataclass(slots=True)
class AdapterPayload:
    name: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    expected_checksums: dict[str, str] = field(default_factory=dict)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's raw bytes (C-contiguous, its own dtype)."""
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _load_safetensors(blob: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(blob)
    except (SafetensorError, ValueError) as exc:
        raise WireFormatError(f"{where}: not a safetensors blob ({exc})", field=where) from None


def decode_adapter_payload(body: bytes, content_type: str) -> AdapterPayload:
    """Decode either body form; raises ``WireFormatError`` naming the bad field."""
    if content_type.split(";")[0].strip().lower() == "application/json":
        return _decode_json(body)
    meta = safetensors_metadata(body)
    name = meta.get("lora_name")
    if not name:
        raise WireFormatError("__metadata__.lora_name: missing", field="__metadata__.lora_name")
    try:
        config = json.loads(meta.get("config_dict", ""))
    except json.JSONDecodeError:
        raise WireFormatError(
            "__metadata__.config_dict: missing or not JSON (the PEFT adapter config)",
            field="__metadata__.config_dict",
        ) from None
    if not isinstance(config, dict):
        raise WireFormatError("__metadata__.config_dict: not an object", field="config_dict")
    return AdapterPayload(name=name, config=config, tensors=_load_safetensors(body, "body"))


def _decode_json(body: bytes) -> AdapterPayload:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WireFormatError(f"body: invalid JSON ({exc})", field="body") from None
    if not isinstance(data, dict):
        raise WireFormatError("body: expected a JSON object", field="body")
    name = data.get("lora_name")
    if not isinstance(name, str) or not name:
        raise WireFormatError("lora_name: missing or empty", field="lora_name")
    config = data.get("config_dict")
    if not isinstance(config, dict):
        raise WireFormatError("config_dict: missing or not an object", field="config_dict")
    load_format = data.get("load_format", "safetensors_b64")
    if load_format not in SUPPORTED_LOAD_FORMATS:
        raise WireFormatError(
            f"load_format: {load_format!r} is not one of {', '.join(SUPPORTED_LOAD_FORMATS)}",
            field="load_format",
        )
    payload = data.get("serialized_tensors")
    if not isinstance(payload, str):
        raise WireFormatError(
            "serialized_tensors: missing or not a string", field="serialized_tensors"
        )
    try:
        blob = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise WireFormatError(
            "serialized_tensors: not base64", field="serialized_tensors"
        ) from None
    checksums = data.get("expected_checksums") or {}
    if not isinstance(checksums, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
    ):
        raise WireFormatError(
            "expected_checksums: must map tensor names to sha256 hex strings",
            field="expected_checksums",
        )
    return AdapterPayload(
        name=name,
        config=dict(config),
        tensors=_load_safetensors(blob, "serialized_tensors"),
        expected_checksums=dict(checksums),
    )


def verify_checksums(payload: AdapterPayload) -> dict[str, str]:
    """The stored tensors' checksums; raises if any expected one differs or is unmatched."""
    actual = {name: tensor_sha256(t) for name, t in payload.tensors.items()}
    for name, expected in sorted(payload.expected_checksums.items()):
        if name not in actual:
            raise WireFormatError(
                f"expected_checksums.{name}: no such tensor in the payload",
                field=f"expected_checksums.{name}",
            )
        if actual[name] != expected:
            raise WireFormatError(
                f"expected_checksums.{name}: the received tensor hashes to {actual[name][:12]}..., "
                f"not {expected[:12]}...",
                field=f"expected_checksums.{name}",
            )
    return actual
