"""One weight-version type: ints everywhere, SGLang's strings converted where they are read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.interface import (
    GenerateMetaInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsResponse,
    WireFormatError,
    is_weight_version,
    parse_weight_version,
)


@given(st.integers(min_value=0, max_value=2**63))
def test_ints_and_their_decimal_strings_are_the_same_version(version: int) -> None:
    assert parse_weight_version(version) == version
    assert parse_weight_version(str(version)) == version
    assert GenerateMetaInfo.parse({"weight_version": str(version)}).weight_version == version
    assert (
        UpdateWeightsResponse.parse({"success": True, "weight_version": version}).weight_version
        == version
    )


def test_sglang_default_and_null_mean_unversioned() -> None:
    assert parse_weight_version("default") is None
    assert parse_weight_version(None) is None
    assert GenerateMetaInfo.parse({"weight_version": "default"}).weight_version is None


@pytest.mark.parametrize("bad", ["v3", "-1", -1, 1.0, True, "", "3.0", [3]])
def test_anything_else_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(WireFormatError, match=r"meta_info\.weight_version") as info:
        parse_weight_version(bad, field="meta_info.weight_version")
    assert info.value.field == "meta_info.weight_version"
    with pytest.raises(WireFormatError, match="weight_version"):
        GenerateMetaInfo.parse({"weight_version": bad})


def test_a_request_sglang_reads_carries_the_version_as_a_string() -> None:
    request = UpdateWeightsFromDiskRequest(model_path="/ckpt", weight_version=7)
    assert request.weight_version == 7
    assert request.to_dict() == {"model_path": "/ckpt", "weight_version": "7"}
    assert UpdateWeightsFromDiskRequest.from_json(request.to_json()) == request


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, True), (7, True), (-1, False), (True, False), (1.0, False), ("3", False), (None, False)],
)
def test_is_weight_version_accepts_only_non_negative_ints(value: object, expected: bool) -> None:
    assert is_weight_version(value) is expected
