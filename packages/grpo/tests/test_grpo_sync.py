"""Weight sync's reads and pushes that need no trainer: an engine's current weight version (read
the way every package reads one, ``interface``), and an update to an in-process ``WeightSink``."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from posttrain.formats import unpack_bucket
from posttrain.grpo import GrpoRunError
from posttrain.grpo.sync import SyncTarget, _push_to_sink, engine_weight_version
from posttrain.interface import BucketManifest, WeightSink, WeightUpdateBegin, WeightUpdateResult


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


class Sink:
    """An in-process ``WeightSink`` (a user's engine): keeps what arrives, or refuses at end."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.header: WeightUpdateBegin | None = None
        self.received: dict[str, torch.Tensor] = {}

    def begin(self, header: WeightUpdateBegin) -> None:
        self.header = header

    def send_bucket(
        self, manifest: BucketManifest, payload: bytes | bytearray | memoryview
    ) -> None:
        self.received.update({k: v.clone() for k, v in unpack_bucket(manifest, payload).items()})

    def end(self, update_id: str) -> WeightUpdateResult:
        assert self.header is not None
        if self.refuse:
            return WeightUpdateResult(success=False, message=self.refuse)
        return WeightUpdateResult(success=True, weight_version=self.header.weight_version)

    def abort(self, update_id: str) -> None:
        self.header = None


def test_a_weight_sink_gets_the_full_weights_or_its_refusal_is_a_run_error() -> None:
    full = SimpleNamespace(lora=None)  # what _push_to_sink reads of a full-training policy
    target = SyncTarget(engine_urls=())
    tensors = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.ones(5, 3)}
    sink = Sink()
    assert isinstance(sink, WeightSink)
    _push_to_sink(sink, full, target, tensors, 4)  # type: ignore[arg-type]
    assert sink.header is not None
    assert (sink.header.kind, sink.header.weight_version) == ("base", 4)
    assert all(torch.equal(sink.received[k], v) for k, v in tensors.items())
    with pytest.raises(GrpoRunError, match="Sink refused version 5: disk full"):
        _push_to_sink(Sink(refuse="disk full"), full, target, tensors, 5)  # type: ignore[arg-type]
