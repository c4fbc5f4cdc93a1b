"""Weight sync's reads and pushes that need no trainer: an engine's current weight version (read
the way every package reads one, ``interface``), which engines a push could not reach (lost, not
fatal, while one took the push), and an update to an in-process ``WeightSink``."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import httpx
import pytest
import torch
from grpo_workers import RecordingSink

from posttrain.grpo import GrpoRunError
from posttrain.grpo.sync import (
    SyncTarget,
    _push_to_sink,
    engine_weight_version,
    push_each,
    unreachable,
)
from posttrain.interface import TransportError, WeightSink
from posttrain.lora import AdapterClient, AdapterPushError


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


def _refusing(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _silent(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("no reply", request=request)


def _push_with(transports: dict[str, httpx.MockTransport]) -> Callable[[str], None]:
    """A push that asks each engine (lora-core's real client) what it can do."""

    def push(url: str) -> None:
        with AdapterClient(url, transport=transports[url], timeout=5) as client:
            client.capabilities()

    return push


def _answering(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"weight_version": "1", "lora_enabled": True})


def test_an_engine_that_cannot_be_reached_is_lost_not_fatal() -> None:
    transports = {
        "http://dead": httpx.MockTransport(_refusing),
        "http://frozen": httpx.MockTransport(_silent),
        "http://alive": httpx.MockTransport(_answering),
    }
    pushed: list[str] = []
    inner = _push_with(transports)

    def push(url: str) -> None:
        inner(url)
        pushed.append(url)

    lost = push_each(["http://dead", "http://alive", "http://frozen"], push)
    assert pushed == ["http://alive"]
    assert [url for url, _ in lost] == ["http://dead", "http://frozen"]
    assert "connection refused" in lost[0][1]
    assert "timed out" in lost[1][1]


def test_losing_every_engine_or_a_refusal_is_a_named_run_error() -> None:
    transports = {
        "http://a": httpx.MockTransport(_refusing),
        "http://b": httpx.MockTransport(_silent),
    }
    with pytest.raises(GrpoRunError, match=r"no engine could be reached \(http://a: .*http://b: "):
        push_each(["http://a", "http://b"], _push_with(transports))

    def refused(url: str) -> None:  # an engine that answered and said no is not "lost"
        raise AdapterPushError(f"{url}: checksum mismatch")

    with pytest.raises(GrpoRunError, match="weight sync to http://a: AdapterPushError"):
        push_each(["http://a", "http://b"], refused)


def test_unreachable_follows_the_raise_from_chain() -> None:
    cause = httpx.ConnectError("refused", request=httpx.Request("GET", "http://e"))
    wrapped = TransportError("GET failed", url="http://e")
    wrapped.__cause__ = cause  # what ``raise TransportError(...) from cause`` sets
    assert unreachable(wrapped)
    context_only = TransportError("GET failed", url="http://e")
    context_only.__context__ = cause  # raised while handling it, not from it: not counted
    assert not unreachable(context_only)
    assert unreachable(TimeoutError())
    assert not unreachable(AdapterPushError("refused"))
    assert not unreachable(ValueError("x"))


def test_a_weight_sink_gets_the_full_weights_or_its_refusal_is_a_run_error() -> None:
    full = SimpleNamespace(lora=None)  # what _push_to_sink reads of a full-training policy
    target = SyncTarget(engine_urls=())
    tensors = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.ones(5, 3)}
    sink = RecordingSink()
    assert isinstance(sink, WeightSink)
    _push_to_sink(sink, full, target, tensors, 4)  # type: ignore[arg-type]
    assert (sink.version, sink.lora_name) == (4, None)
    assert all(torch.equal(sink.received[k], v) for k, v in tensors.items())
    with pytest.raises(
        GrpoRunError, match="RecordingSink refused version 5: RuntimeError: disk full"
    ):
        _push_to_sink(RecordingSink(refuse="disk full"), full, target, tensors, 5)  # type: ignore[arg-type]
