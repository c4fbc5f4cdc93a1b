"""The engine's current weight version, read the way every package reads one (``interface``)."""

from __future__ import annotations

import httpx
import pytest

from posttrain.grpo import GrpoRunError
from posttrain.grpo.sync import engine_weight_version


def _engine(reply: httpx.Response) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/model_info"
        return reply

    return httpx.MockTransport(handle)


@pytest.mark.parametrize(("reported", "version"), [(7, 7), ("3", 3), ("default", 0), (None, 0)])
def test_reported_versions_are_read_as_ints(reported: object, version: int) -> None:
    transport = _engine(httpx.Response(200, json={"weight_version": reported}))
    assert engine_weight_version("http://e", timeout_s=5, transport=transport) == version


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (httpx.Response(200, json={"weight_version": "v3"}), "'v3' is not a weight version"),
        (httpx.Response(200, json=[1, 2]), "model_info"),
        (httpx.Response(503, json={"error": "x"}), "answered 503"),
    ],
)
def test_a_bad_answer_is_a_named_run_error(reply: httpx.Response, match: str) -> None:
    with pytest.raises(GrpoRunError, match=match):
        engine_weight_version("http://e", timeout_s=5, transport=_engine(reply))
