"""samples/1: exact round trip (hypothesis), strict decoding, and named errors on corrupt bytes."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from posttrain.formats import (
    SAMPLES_FORMAT,
    DecodedSamples,
    SamplesFormatError,
    decode_samples,
    encode_samples,
)
from posttrain.interface import Sample, SampleStatus, WireFormatError

token = st.integers(min_value=0, max_value=2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
json_scalar = (
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | finite | st.text(max_size=5)
)
json_value = st.recursive(
    json_scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 6))
    return Sample(
        prompt_ids=draw(st.lists(token, max_size=6)),
        response_ids=draw(st.lists(token, min_size=n, max_size=n)),
        rollout_logprobs=draw(st.lists(finite, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
        reward=draw(st.none() | finite),
        status=draw(st.sampled_from(SampleStatus)),
        weight_version=draw(st.none() | st.integers(0, 2**62)),
        metadata=draw(st.dictionaries(st.text(max_size=4), json_value, max_size=3)),
        group_index=draw(st.none() | st.integers(0, 2**31)),
        index=draw(st.none() | st.integers(0, 2**31)),
    )


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(samples(), max_size=4),
    session=st.dictionaries(st.text(max_size=4), json_value, max_size=3),
    empty_reason=st.none() | st.sampled_from(["no_records", "all_truncated"]),
)
def test_round_trip_is_exact(
    batch: list[Sample], session: dict[str, Any], empty_reason: str | None
) -> None:
    data = encode_samples(batch, session_metadata=session, empty_reason=empty_reason)
    decoded = decode_samples(data)
    assert decoded == DecodedSamples(
        samples=batch, session_metadata=session, empty_reason=empty_reason
    )
    assert json.loads(st_load(data)["_samples_meta"].tobytes())["format"] == SAMPLES_FORMAT


def _payload(**tensors: np.ndarray[Any, Any]) -> bytes:
    return bytes(st_save(tensors))


def _good() -> bytes:
    return encode_samples(
        [
            Sample(
                prompt_ids=[1],
                response_ids=[2, 3],
                rollout_logprobs=[-0.5, -1.0],
                loss_mask=[1, 0],
                weight_version=4,
            )
        ]
    )


def _with_meta(change: dict[str, Any]) -> bytes:
    tensors = dict(st_load(_good()))
    meta = json.loads(tensors["_samples_meta"].tobytes())
    meta["samples"][0].update(change)
    tensors["_samples_meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8).copy()
    return _payload(**tensors)


def test_decode_is_strict() -> None:
    tensors = dict(st_load(_good()))
    with pytest.raises(SamplesFormatError, match=r"tokens\.0: dtype int32") as info:
        decode_samples(_payload(**{**tensors, "tokens.0": tensors["tokens.0"].astype(np.int32)}))
    assert info.value.field == "tokens.0"
    assert isinstance(info.value, WireFormatError)
    with pytest.raises(SamplesFormatError, match="unexpected tensors"):
        decode_samples(_payload(**tensors, **{"extra.0": np.zeros(2, dtype=np.int64)}))
    with pytest.raises(SamplesFormatError, match=r"loss_mask\.0: tensor missing"):
        decode_samples(_payload(**{k: v for k, v in tensors.items() if k != "loss_mask.0"}))
    with pytest.raises(SamplesFormatError, match="not a safetensors payload"):
        decode_samples(b"garbage")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"response_length": 9}, "response_length: 9 does not fit 3 tokens"),
        ({"response_length": True}, r"response_length: expected int or null, got True"),
        ({"weight_version": "4"}, r"weight_version: expected int or null, got '4'"),
        ({"weight_version": -1}, "weight_version must be a non-negative int"),
        ({"metadata": [1]}, r"metadata: expected dict or null"),
        ({"status": "done"}, r"samples\[0\]: 'done' is not a valid SampleStatus"),
        ({"reward": "high"}, r"reward: expected int or float or null"),
        ({"group_index": 1.5}, r"group_index: expected int or null"),
    ],
)
def test_every_metadata_field_is_type_checked(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SamplesFormatError, match=message):
        decode_samples(_with_meta(change))


def test_encode_refuses_value_changing_casts() -> None:
    s = Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.5], loss_mask=[1])
    s.loss_mask = [300]  # bypasses validation on purpose: uint8 cannot hold it
    with pytest.raises(SamplesFormatError, match=r"loss_mask\.0"):
        encode_samples([s])
    with pytest.raises(SamplesFormatError, match="not JSON-serializable"):
        encode_samples([], session_metadata={"x": object()})


def test_decode_overlays_onto_a_copy_of_the_driver_sample() -> None:
    base = Sample(
        prompt_ids=[1],
        response_ids=[],
        rollout_logprobs=[],
        loss_mask=[],
        group_index=4,
        index=2,
        metadata={"prompt": "p"},
    )
    wire = Sample(
        prompt_ids=[1, 7],
        response_ids=[8],
        rollout_logprobs=[-0.25],
        loss_mask=[1],
        weight_version=2,
        metadata={"num_turns": 1},
    )
    (out,) = decode_samples(encode_samples([wire]), base=base).samples
    assert out is not base
    assert base.response_ids == []
    assert out.tokens == [1, 7, 8]
    assert (out.group_index, out.index, out.weight_version) == (4, 2, 2)
    assert out.metadata == {"prompt": "p", "num_turns": 1}


def _decodes_or_names_the_error(data: bytes) -> None:
    """Decoding succeeds or raises a ``SamplesFormatError`` naming a tensor or field."""
    error: SamplesFormatError | None = None
    try:
        decoded = decode_samples(data)
    except SamplesFormatError as exc:
        error = exc
    else:
        assert isinstance(decoded, DecodedSamples)
    assert error is None or error.field, error


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_bytes_decode_or_raise_a_named_error(data: st.DataObject, corrupt: Any) -> None:
    _decodes_or_names_the_error(corrupt(data, _good()))


@settings(max_examples=200, deadline=None)
@given(entry=st.dictionaries(st.sampled_from(
    ["response_length", "status", "weight_version", "reward", "metadata", "group_index", "index"]
), json_value, max_size=7), session=json_value, empty_reason=json_value)  # fmt: skip
def test_arbitrary_metadata_decodes_or_raises_a_named_error(
    entry: dict[str, Any], session: Any, empty_reason: Any
) -> None:
    tensors = dict(st_load(_good()))
    meta = {
        "format": SAMPLES_FORMAT,
        "samples": [entry],
        "session_metadata": session,
        "empty_reason": empty_reason,
    }
    tensors["_samples_meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8).copy()
    _decodes_or_names_the_error(_payload(**tensors))
