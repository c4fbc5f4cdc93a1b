"""The trainer-side wsync/1 client: a ``WeightSink`` over HTTP and shared memory, and its errors.

The receiving side here is a small in-test engine behind ``httpx.MockTransport`` that decodes
what arrives with this package's own readers (``decode_bucket_body``; ``unpack_bucket`` over
the ring file), so both directions of the format meet. local-engine's tests push to the real
engine.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from posttrain.formats import (
    FormatsConfigError,
    ShmRing,
    WeightPushClient,
    decode_bucket_body,
    expected_tensors,
    pack_bucket,
    push_weights,
    unpack_bucket,
)
from posttrain.interface import (
    EngineError,
    IncompleteUpdateError,
    ShmBucketRequest,
    StaleVersionError,
    WeightSink,
    WeightUpdateBegin,
    WeightUpdateResult,
)


class Receiver:
    """What an engine does with wsync/1 requests, minus the model: stage, check, answer."""

    def __init__(self) -> None:
        self.begin: WeightUpdateBegin | None = None
        self.staged: dict[str, torch.Tensor] = {}
        self.routes: list[str] = []
        self.slots: list[int] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.routes.append(path)
        if path == "/begin_weight_update":
            self.begin = WeightUpdateBegin.from_json(request.content)
            return httpx.Response(200, json={"success": True})
        if path == "/update_weights_from_safetensors":
            _, tensors = decode_bucket_body(request.content)
            self.staged.update({k: v.clone() for k, v in tensors.items()})
            return httpx.Response(200, json={"success": True})
        if path == "/update_weights_from_shm":
            req = ShmBucketRequest.from_json(request.content)
            assert req.slot_bytes is not None
            ring = torch.from_file(
                req.shm_path, shared=True, size=2 * req.slot_bytes, dtype=torch.uint8
            )
            view = ring[req.slot * req.slot_bytes : (req.slot + 1) * req.slot_bytes]
            self.staged.update({k: v.clone() for k, v in unpack_bucket(req.manifest, view).items()})
            self.slots.append(req.slot)
            return httpx.Response(200, json={"success": True})
        if path == "/end_weight_update":
            assert self.begin is not None
            missing = sorted({t.name for t in self.begin.expected} - set(self.staged))
            if missing:
                return httpx.Response(400, json={"success": False, "missing": missing,
                                                 "message": f"missing {missing}"})  # fmt: skip
            return httpx.Response(
                200, json={"success": True, "weight_version": self.begin.weight_version}
            )
        return httpx.Response(404, json={"error": f"no route {path}"})


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "embed": torch.randn(40, 8, generator=gen).to(torch.bfloat16),
        "scale": torch.randn(1, generator=gen),  # fp32 beside bf16 in one bucket
        "norm": torch.randn(8, generator=gen).to(torch.bfloat16),
        "big": torch.randn(300, generator=gen),  # larger than the cap: a bucket of its own
        "ids": torch.arange(5),
    }


def test_the_client_is_a_weight_sink() -> None:
    with WeightPushClient("http://engine", transport=httpx.MockTransport(Receiver())) as client:
        assert isinstance(client, WeightSink)


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_push_delivers_every_tensor_exactly(transport: str) -> None:
    receiver, weights = Receiver(), _weights()
    with WeightPushClient("http://engine", transport=httpx.MockTransport(receiver)) as client:
        result = push_weights(
            client, weights, weight_version=7, transport=transport,  # type: ignore[arg-type]
            bucket_bytes=512, with_sha256=True,
        )  # fmt: skip
        assert client.ring is None  # the ring made for this push is gone again
    assert result.success
    assert result.weight_version == 7
    assert receiver.begin is not None
    assert [(t.name, t.dtype, t.shape) for t in receiver.begin.expected] == [
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in weights.items()
    ]
    assert set(receiver.staged) == set(weights)
    assert all(torch.equal(receiver.staged[k], v) for k, v in weights.items())
    buckets = [r for r in receiver.routes if r.startswith("/update_weights_from_")]
    assert len(buckets) >= 3
    if transport == "shm":
        assert receiver.slots == [k % 2 for k in range(len(buckets))]  # the two slots alternate


def test_a_bucket_packed_elsewhere_is_copied_into_the_ring() -> None:
    receiver = Receiver()
    with ShmRing(1024) as ring, WeightPushClient(
        "http://engine", transport=httpx.MockTransport(receiver), ring=ring
    ) as client:  # fmt: skip
        items = [("a", torch.ones(3))]
        client.begin(WeightUpdateBegin(update_id="u", weight_version=1, kind="base",
                                       expected=expected_tensors(items)))  # fmt: skip
        manifest, buf = pack_bucket(items, update_id="u", weight_version=1, bucket_index=1)
        client.send_bucket(manifest, bytes(buf.numpy()))
        assert client.end("u").success
    assert receiver.slots == [1]
    assert torch.equal(receiver.staged["a"], torch.ones(3))


def _answering(status: int, body: dict[str, Any], route: str) -> httpx.MockTransport:
    receiver = Receiver()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == route:
            return httpx.Response(status, content=json.dumps(body).encode())
        return receiver(request)

    return httpx.MockTransport(handler)


def test_every_non_200_raises_a_typed_error_naming_the_url() -> None:
    weights = {"w": torch.ones(2)}
    cases = [
        (_answering(409, {"error": "version 3 does not increase"}, "/begin_weight_update"),
         StaleVersionError, "does not increase"),
        (_answering(400, {"success": False, "missing": ["w"], "message": "missing ['w']"},
                    "/end_weight_update"), IncompleteUpdateError, "missing"),
        (_answering(500, {"error": "boom"}, "/update_weights_from_safetensors"),
         EngineError, r"http://engine/update_weights_from_safetensors: HTTP 500: boom"),
    ]  # fmt: skip
    for transport, error, message in cases:
        with WeightPushClient("http://engine", transport=transport) as client, pytest.raises(
            error, match=message
        ):  # fmt: skip
            push_weights(client, weights, weight_version=3)

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with WeightPushClient("http://engine", transport=httpx.MockTransport(unreachable)) as client:
        with pytest.raises(EngineError, match="ConnectError") as info:
            push_weights(client, weights, weight_version=3)
        assert info.value.url == "http://engine/begin_weight_update"


def test_bad_arguments_are_refused() -> None:
    client = WeightPushClient("http://engine", transport=httpx.MockTransport(Receiver()))
    with client, pytest.raises(FormatsConfigError, match="bucket_bytes must be > 0"):
        push_weights(client, {"w": torch.ones(1)}, weight_version=1, bucket_bytes=0)
    with pytest.raises(FormatsConfigError, match="do not fit"):
        ShmRing(1 << 62)


def test_a_push_over_http_leaves_the_clients_ring_alone_and_unused() -> None:
    receiver, weights = Receiver(), _weights()
    with ShmRing(4096) as ring, WeightPushClient(
        "http://engine", transport=httpx.MockTransport(receiver), ring=ring
    ) as client:  # fmt: skip
        assert push_weights(client, weights, weight_version=3, transport="http").success
        assert client.ring is ring
        shm = push_weights(client, weights, weight_version=4, transport="shm", bucket_bytes=512)
        assert shm.success
        assert client.ring is ring  # the client's ring carried it, and stays
    routes = [r for r in receiver.routes if r.startswith("/update_weights_from_")]
    assert routes[0] == "/update_weights_from_safetensors"
    assert set(routes[1:]) == {"/update_weights_from_shm"}
    assert all(torch.equal(receiver.staged[k], v) for k, v in weights.items())


class InProcessSink:
    """A ``WeightSink`` that is no HTTP client: a user's engine taking updates in process."""

    def __init__(self) -> None:
        self.header: WeightUpdateBegin | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.buckets = 0

    def begin(self, header: WeightUpdateBegin) -> None:
        self.header = header

    def send_bucket(self, manifest: Any, payload: bytes | bytearray | memoryview) -> None:
        assert isinstance(payload, memoryview)  # the packed bytes, not a torch tensor
        self.buckets += 1
        for name, view in unpack_bucket(manifest, payload).items():
            self.received[name] = view.clone()

    def end(self, update_id: str) -> WeightUpdateResult:
        assert self.header is not None
        assert update_id == self.header.update_id
        return WeightUpdateResult(success=True, weight_version=self.header.weight_version)

    def abort(self, update_id: str) -> None:
        raise AssertionError("a successful push never aborts")


def test_any_weight_sink_takes_a_push_bucket_by_bucket() -> None:
    sink, weights = InProcessSink(), _weights()
    assert isinstance(sink, WeightSink)
    result = push_weights(sink, weights, weight_version=7, bucket_bytes=512, with_sha256=True)
    assert result.success
    assert result.weight_version == 7
    assert sink.buckets >= 2  # "big" travels alone
    assert sink.received.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(sink.received[name], tensor), name
    with pytest.raises(FormatsConfigError, match="transport='shm' needs a WeightPushClient"):
        push_weights(InProcessSink(), weights, weight_version=8, transport="shm")
