"""``/load_lora_adapter_from_tensors`` bodies: both forms decode, and every bad field is named."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from safetensors.torch import save

from posttrain.interface import WireFormatError
from posttrain.local_engine._adapter_payload import (
    decode_adapter_payload,
    tensor_sha256,
    verify_checksums,
)

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
TENSORS = {KEY: torch.arange(8, dtype=torch.float32).reshape(2, 4)}


def _json_body(**changes: object) -> bytes:
    body: dict[str, object] = {
        "lora_name": "a",
        "config_dict": {"r": 2, "lora_alpha": 4},
        "serialized_tensors": base64.b64encode(save(TENSORS)).decode(),
        "load_format": "safetensors_b64",
        "expected_checksums": {KEY: tensor_sha256(TENSORS[KEY])},
    }
    body.update(changes)
    return json.dumps(body).encode()


def test_both_forms_decode_to_the_same_tensors() -> None:
    from_json = decode_adapter_payload(_json_body(), "application/json")
    raw = save(TENSORS, metadata={"lora_name": "a", "config_dict": json.dumps({"r": 2})})
    from_raw = decode_adapter_payload(raw, "application/octet-stream")
    assert torch.equal(from_json.tensors[KEY], from_raw.tensors[KEY])
    assert from_json.name == from_raw.name == "a"
    assert verify_checksums(from_json) == {KEY: tensor_sha256(TENSORS[KEY])}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"lora_name": ""}, "lora_name"),
        ({"config_dict": "r=2"}, "config_dict"),
        ({"load_format": "pickle"}, "load_format"),
        ({"serialized_tensors": "%%%"}, "serialized_tensors"),
        ({"serialized_tensors": base64.b64encode(b"not safetensors").decode()},
         "serialized_tensors"),
        ({"expected_checksums": {KEY: 3}}, "expected_checksums"),
    ],
)  # fmt: skip
def test_bad_json_fields_are_named(changes: dict[str, object], field: str) -> None:
    with pytest.raises(WireFormatError) as info:
        decode_adapter_payload(_json_body(**changes), "application/json")
    assert info.value.field == field


def test_checksum_mismatch_and_unknown_names() -> None:
    wrong = decode_adapter_payload(
        _json_body(expected_checksums={KEY: "0" * 64}), "application/json"
    )
    with pytest.raises(WireFormatError, match="hashes to"):
        verify_checksums(wrong)
    unknown = decode_adapter_payload(
        _json_body(expected_checksums={"nope": "0" * 64}), "application/json"
    )
    with pytest.raises(WireFormatError, match="no such tensor"):
        verify_checksums(unknown)
