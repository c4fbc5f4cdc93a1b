"""The adapter push of ``/load_lora_adapter_from_tensors``, in SGLang's body, both directions.

SGLang's ``LoadLoRAAdapterFromTensorsReqInput``: ``lora_name``, ``config_dict`` (the PEFT
``adapter_config.json``), ``serialized_named_tensors`` (one serialized copy of the tensors per
TP rank, base64 over HTTP; each rank reads its own), ``pinned``, ``load_format`` and
``expected_checksums``. ``lora-core``'s ``AdapterClient`` writes it (``adapter_push_body``) and
posttrain's local engine reads it (``decode_adapter_payload``): every copy is read with the
restricted unpickler of ``_named_tensors`` (plain tensors by value only, never code) and must
hold the same tensors as rank 0's.

Checksums are ``tensor_sha256``: sha256 hex of each tensor's raw C-contiguous bytes in its own
dtype. With ``expected_checksums`` the receiver checks every tensor before anything is loaded
(``verify_adapter_checksums``) and echoes the checksums of what it stored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.formats._errors import AdapterPayloadError
from posttrain.formats._named_tensors import deserialize_named_tensors, serialize_named_tensors
from posttrain.formats._safetensors import tensor_bytes
from posttrain.formats._sglang_requests import LoadLoraAdapterFromTensorsReq

__all__ = [
    "AdapterPayload",
    "adapter_push_body",
    "decode_adapter_payload",
    "tensor_sha256",
    "verify_adapter_checksums",
]


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


def adapter_push_body(
    name: str,
    config_dict: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    tp_size: int = 1,
    expected_checksums: Mapping[str, str] | None = None,
    pinned: bool = False,
) -> LoadLoraAdapterFromTensorsReq:
    """SGLang's body: the tensors serialized once, one copy per TP rank."""
    if tp_size < 1:
        raise AdapterPayloadError(f"tp_size must be >= 1, got {tp_size}", field="tp_size")
    blob = serialize_named_tensors(tensors)
    return LoadLoraAdapterFromTensorsReq(
        lora_name=name,
        config_dict=dict(config_dict),
        serialized_named_tensors=[blob] * tp_size,
        pinned=pinned,
        expected_checksums=dict(expected_checksums) if expected_checksums else None,
    )


def decode_adapter_payload(req: LoadLoraAdapterFromTensorsReq) -> AdapterPayload:
    """Read a parsed body; raises ``AdapterPayloadError`` naming the bad field."""
    if req.load_format not in (None, "direct"):
        raise AdapterPayloadError(
            f"load_format: {req.load_format!r} is not read by this engine (plain named tensors)",
            field="load_format",
        )
    copies = req.serialized_named_tensors
    tensors = deserialize_named_tensors(copies[0])
    for rank, blob in enumerate(copies[1:], start=1):
        if blob != copies[0]:
            raise AdapterPayloadError(
                f"serialized_named_tensors[{rank}]: differs from rank 0's copy (a one-rank "
                "engine serves every rank's tensors)",
                field=f"serialized_named_tensors[{rank}]",
            )
    return AdapterPayload(
        name=req.lora_name,
        config=dict(req.config_dict),
        tensors=tensors,
        expected_checksums=dict(req.expected_checksums or {}),
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
