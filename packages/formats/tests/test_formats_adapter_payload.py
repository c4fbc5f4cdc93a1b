"""``/load_lora_adapter_from_tensors`` bodies: what the client writes the engine reads, both
forms decode, and every bad field is named."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
import torch
from safetensors.torch import save

from posttrain.formats import (
    AdapterPayloadError,
    adapter_push_body,
    decode_adapter_payload,
    encode_safetensors_b64,
    tensor_sha256,
    verify_adapter_checksums,
)
from posttrain.interface import WireFormatError

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
    assert verify_adapter_checksums(from_json) == {KEY: tensor_sha256(TENSORS[KEY])}


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


@pytest.mark.parametrize(
    "raw",
    [b"xx", (1 << 40).to_bytes(8, "little") + b"{}", (2).to_bytes(8, "little") + b"[]", b"\0" * 8],
)
def test_a_bad_raw_body_is_an_adapter_payload_error(raw: bytes) -> None:
    # The raw form's header is read before its tensors; a bad one is this format's error,
    # not another format's (it was a wsync/1 BucketFormatError).
    with pytest.raises(AdapterPayloadError) as info:
        decode_adapter_payload(raw, "application/octet-stream")
    assert info.value.field


def test_checksum_mismatch_and_unknown_names() -> None:
    wrong = decode_adapter_payload(
        _json_body(expected_checksums={KEY: "0" * 64}), "application/json"
    )
    with pytest.raises(WireFormatError, match="hashes to"):
        verify_adapter_checksums(wrong)
    unknown = decode_adapter_payload(
        _json_body(expected_checksums={"nope": "0" * 64}), "application/json"
    )
    with pytest.raises(WireFormatError, match="no such tensor"):
        verify_adapter_checksums(unknown)


def test_the_pushed_body_decodes_to_what_was_pushed() -> None:
    blob, load_format = encode_safetensors_b64(TENSORS)
    sums = {k: tensor_sha256(v) for k, v in TENSORS.items()}
    body = adapter_push_body(
        "a", {"r": 2}, blob, load_format=load_format, expected_checksums=sums, upsert=True
    )
    assert body["upsert"] is True
    got = decode_adapter_payload(json.dumps(body).encode(), "application/json")
    assert (got.name, got.config, got.expected_checksums) == ("a", {"r": 2}, sums)
    assert verify_adapter_checksums(got) == sums
    assert torch.equal(got.tensors[KEY], TENSORS[KEY])


def test_errors_are_wire_format_errors_and_the_checksum_is_of_the_raw_bytes() -> None:
    assert issubclass(AdapterPayloadError, WireFormatError)
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()  # not contiguous
    assert tensor_sha256(t) == hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
