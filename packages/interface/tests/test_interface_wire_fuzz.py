"""Fuzzing every wire type with untrusted JSON and bytes (issue #18).

Engines and routers parse these from the network. Whatever arrives, ``parse`` and
``from_json`` either return a model or raise ``WireFormatError`` naming a field; no other
exception escapes, and whatever parses round-trips exactly through ``to_json``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posttrain.interface as iface
from posttrain.interface import WireFormatError, WireModel

WIRE_TYPES = sorted(
    (
        obj
        for name in iface.__all__
        if isinstance(obj := getattr(iface, name), type)
        and issubclass(obj, WireModel)
        and obj is not WireModel
    ),
    key=lambda t: t.__name__,
)

_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["base", "lora", "bfloat16", "float32", "stop", "user"])
)
_json = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=16,
)


def _objects_for(model: type[WireModel]) -> st.SearchStrategy[Any]:
    """JSON objects whose keys are mostly the model's own fields: deep enough to reach validators."""
    keys = st.sampled_from(sorted(model.model_fields)) | st.text(max_size=6)
    return st.dictionaries(keys, _json, max_size=len(model.model_fields) + 1) | _json


@pytest.mark.parametrize("model", WIRE_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_parse_gives_a_model_or_a_named_error(model: type[WireModel], data: Any) -> None:
    value = data.draw(_objects_for(model))
    field: str | None = None
    parsed: WireModel | None = None
    try:
        parsed = model.parse(value)
    except WireFormatError as exc:
        field = exc.field
    if parsed is None:
        assert field  # the bad field is named
        return
    assert model.from_json(parsed.to_json()) == parsed


@pytest.mark.parametrize("model", WIRE_TYPES, ids=lambda t: t.__name__)
@settings(max_examples=40, deadline=None)
@given(raw=st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()))
def test_fuzz_from_json_bytes(model: type[WireModel], raw: bytes) -> None:
    with contextlib.suppress(WireFormatError):
        model.from_json(raw)


def test_there_are_wire_types_to_fuzz() -> None:
    names = {t.__name__ for t in WIRE_TYPES}
    assert {"GenerateRequest", "ChatCompletionRequest", "UpdateWeightsFromDiskRequest"} <= names
