"""``AdapterClient`` against a real HTTP server on 127.0.0.1 (a small SGLang-like LoRA engine).

The server runs in a thread of the test process (stdlib ``ThreadingHTTPServer``) and is shut
down by the fixture; it decodes the tensors it is sent, verifies ``expected_checksums`` itself
and echoes the checksums of what it stored, so checksum mismatches are real.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import torch

from posttrain.formats import (
    LoadLoraAdapterFromTensorsReq,
    deserialize_named_tensors,
    tensor_sha256,
)
from posttrain.interface import TransportError
from posttrain.lora import (
    AdapterClient,
    AdapterPushError,
    ChecksumMismatchError,
    LoraServing,
    request_fields,
    serves_lora,
)


class FakeEngine:
    def __init__(self) -> None:
        self.adapters: dict[str, dict[str, torch.Tensor] | str] = {}
        self.capabilities: list[str] = ["checksums"]
        self.enable_lora = True
        self.corrupt = False  # flip one byte of what it stores
        self.delay_s = 0.0
        self.calls: list[str] = []


def make_handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError):  # the client gave up (timeout test)
                self.wfile.write(data)

        def fail(self, message: str) -> None:
            self.reply(
                400,
                {
                    "success": False,
                    "error_message": message,
                    "loaded_adapters": sorted(engine.adapters),
                },
            )

        def do_GET(self) -> None:
            if self.path != "/server_info":
                self.reply(404, {"detail": "Not Found"})
                return
            self.reply(
                200,
                {
                    "enable_lora": engine.enable_lora,
                    "max_lora_rank": 8,
                    "lora_capabilities": engine.capabilities,
                },
            )

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            engine.calls.append(self.path)
            time.sleep(engine.delay_s)
            name = body.get("lora_name")
            if self.path == "/load_lora_adapter":
                if name in engine.adapters:
                    self.fail(f"LoRA adapter {name} is already loaded")
                    return
                engine.adapters[name] = body["lora_path"]
                self.reply(200, {"success": True, "loaded_adapters": sorted(engine.adapters)})
            elif self.path == "/unload_lora_adapter":
                if name not in engine.adapters:
                    self.fail(f"LoRA adapter {name} is not loaded")
                    return
                del engine.adapters[name]
                self.reply(200, {"success": True, "loaded_adapters": sorted(engine.adapters)})
            elif self.path == "/load_lora_adapter_from_tensors":
                if name in engine.adapters and "replace" not in engine.capabilities:
                    self.fail(f"LoRA adapter {name} is already loaded")
                    return
                req = LoadLoraAdapterFromTensorsReq.parse(body)  # SGLang's body, exactly
                tensors = deserialize_named_tensors(req.serialized_named_tensors[0])
                if engine.corrupt:
                    k = sorted(tensors)[0]
                    tensors[k] = tensors[k].clone()
                    tensors[k].view(-1)[0] += 1
                sums = {k: tensor_sha256(v) for k, v in tensors.items()}
                expected = body.get("expected_checksums") or {}
                bad = [k for k in expected if expected[k] != sums.get(k)]
                if bad and "checksums" in engine.capabilities:
                    self.fail(f"checksum mismatch for {bad[0]}")
                    return
                engine.adapters[name] = tensors
                self.reply(
                    200,
                    {
                        "success": True,
                        "loaded_adapters": sorted(engine.adapters),
                        "checksums": sums,
                    },
                )
            else:
                self.reply(404, {"detail": "Not Found"})

    return Handler


@pytest.fixture
def engine() -> Iterator[tuple[FakeEngine, str]]:
    state = FakeEngine()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


TENSORS = {
    "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 8).to(torch.bfloat16),
    "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(8, 4).to(torch.bfloat16),
}
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def test_load_by_path_and_unload(engine: tuple[FakeEngine, str]) -> None:
    _state, url = engine
    with AdapterClient(url, timeout=5.0) as client:
        caps = client.capabilities()
        assert caps.lora_enabled
        assert caps.checksums
        assert caps.max_lora_rank == 8
        reply = client.load_from_path("policy", "/ckpt/adapter")
        assert reply["loaded_adapters"] == ["policy"]
        with pytest.raises(AdapterPushError, match="already loaded") as err:
            client.load_from_path("policy", "/ckpt/adapter")
        assert err.value.status == 400
        assert err.value.url.endswith("/load_lora_adapter")
        assert client.unload("policy") is True
        assert client.unload("policy") is False  # "not loaded" is the one refusal ignored


@pytest.mark.parametrize(
    ("capabilities", "calls"),
    [
        # SGLang refuses a loaded name: unload, then load, in SGLang's body
        (["checksums"], ["/unload_lora_adapter", "/load_lora_adapter_from_tensors"]),
        # posttrain's local engine replaces a loaded adapter itself: one load, no moment without
        (["checksums", "replace"], ["/load_lora_adapter_from_tensors"]),
    ],
)
def test_push_replaces_the_adapter(
    engine: tuple[FakeEngine, str], capabilities: list[str], calls: list[str]
) -> None:
    state, url = engine
    state.capabilities = capabilities
    with AdapterClient(url, timeout=5.0) as client:
        client.push("policy", TENSORS, CONFIG)
        client.push("policy", {k: v * 2 for k, v in TENSORS.items()}, CONFIG)
    stored = state.adapters["policy"]
    assert isinstance(stored, dict)
    assert all(torch.equal(stored[k], TENSORS[k] * 2) for k in TENSORS)
    assert state.calls == calls * 2


def test_checksum_mismatch_is_an_error(engine: tuple[FakeEngine, str]) -> None:
    state, url = engine
    state.corrupt = True
    with (
        AdapterClient(url, timeout=5.0) as client,
        pytest.raises(ChecksumMismatchError, match="lora_A"),
    ):
        client.push("policy", TENSORS, CONFIG)
    assert "policy" not in state.adapters
    # an engine that does not verify but echoes what it stored: the client compares itself
    state.capabilities = []
    with (
        AdapterClient(url, timeout=5.0) as client,
        pytest.raises(ChecksumMismatchError, match="differs"),
    ):
        client.push("policy", TENSORS, CONFIG)


def test_success_false_and_missing_capability(engine: tuple[FakeEngine, str]) -> None:
    state, url = engine
    with (
        AdapterClient(url, timeout=5.0) as client,
        pytest.raises(AdapterPushError, match="max_lora_rank"),
    ):
        client.load_from_tensors("policy", TENSORS, {**CONFIG, "r": 16})
    state.enable_lora = False
    with (
        AdapterClient(url, timeout=5.0) as client,
        pytest.raises(AdapterPushError, match="enable_lora"),
    ):
        client.push("policy", TENSORS, CONFIG)


def test_timeouts_and_unreachable_raise_transport_error(engine: tuple[FakeEngine, str]) -> None:
    state, url = engine
    with AdapterClient(url, timeout=5.0) as client:
        client.capabilities()
        state.delay_s = 1.0
        client._http.timeout = httpx.Timeout(0.2)
        with pytest.raises(TransportError, match="timed out") as err:
            client.unload("policy")
        assert err.value.url.endswith("/unload_lora_adapter")
    with AdapterClient("http://127.0.0.1:9", timeout=2.0) as client, pytest.raises(TransportError):
        client.capabilities()


def test_mock_transport_and_bearer_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/server_info":
            return httpx.Response(404)
        return httpx.Response(200, json={"lora_paths": {"a": "/a"}, "max_lora_rank": None})

    with AdapterClient(
        "http://engine", transport=httpx.MockTransport(handler), api_key="k"
    ) as client:
        caps = client.capabilities()
    assert caps.lora_enabled
    assert not caps.checksums
    assert [r.url.path for r in seen] == ["/server_info", "/get_server_info"]
    assert seen[0].headers["authorization"] == "Bearer k"


def test_request_fields_are_the_formats_ones() -> None:
    import posttrain.formats as formats

    # One implementation (posttrain.formats, shared with the session router), re-exported here.
    assert (LoraServing, serves_lora, request_fields) == (
        formats.LoraServing,
        formats.serves_lora,
        formats.request_fields,
    )
    assert serves_lora(LoraServing(adapter_name="policy"))
    assert request_fields("policy", 3) == {"lora_path": "policy", "extra_key": "policy:v3"}
