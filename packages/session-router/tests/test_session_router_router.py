"""The real sgl-router (from the sglang-router wheel) with loopback workers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from posttrain.formats import decode_samples
from posttrain.interface import Sample
from posttrain.interface.testing import ServerProcess, free_port, stop_process_group
from posttrain.session_router import (
    LoopbackWorker,
    RouterHandle,
    RouterIncompatible,
    RouterSpec,
    RouterStartError,
    SessionClient,
    SessionNotFoundError,
    SessionRouterConfig,
    default_probe_body,
    start_router,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]


def test_registration_call_order_and_add_remove(router: RouterHandle) -> None:
    with LoopbackWorker() as worker:
        router.add_worker(worker.url)
        assert router.workers() == [worker.url]
        first = list(dict.fromkeys(worker.calls))[:3]
        assert first == [("GET", "/health"), ("GET", "/server_info"), ("GET", "/model_info")]
        router.remove_worker(worker.url)
        assert router.workers() == []
        r = httpx.post(f"{router.url}/generate", json={"input_ids": [1]}, timeout=10)
        assert r.status_code == 503


def test_router_forwards_chat_text_to_a_loopback_chat_route(router: RouterHandle) -> None:
    """The benchmark's equal-work baseline: chat text through the router to the worker's chat route."""
    seen: list[dict[str, Any]] = []

    def chat(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        return {"object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 3}}

    with LoopbackWorker(chat=chat) as worker:
        router.add_worker(worker.url)
        try:
            messages = [{"role": "user", "content": "hello there"}]
            r = httpx.post(
                f"{router.url}/v1/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": 4},
                headers={"X-SMG-Routing-Key": "chat-key"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"] == {"prompt_tokens": 3}
            assert len(seen) == 1
            assert seen[0]["messages"] == messages
        finally:
            router.remove_worker(worker.url)
    with LoopbackWorker() as plain:  # without a chat function the route stays a 404
        r = httpx.post(f"{plain.url}/v1/chat/completions", json={"messages": []}, timeout=10)
        assert r.status_code == 404


def test_dp_aware_worker_names_are_stripped() -> None:
    with (
        start_router(RouterSpec(port=free_port(), dp_aware=True)) as handle,
        LoopbackWorker(dp_size=2) as worker,
    ):
        handle.add_worker(worker.url)
        assert sorted(w["url"] for w in handle.list_workers()) == [
            f"{worker.url}@0",
            f"{worker.url}@1",
        ]
        assert handle.workers() == [worker.url]
        r = httpx.post(f"{handle.url}/generate", json={"input_ids": [1, 2]}, timeout=10)
        assert r.status_code == 200
        _, arrived = worker.generate_requests[-1]
        assert arrived["data_parallel_rank"] in (0, 1)
        # sglang-router 0.3.2 cannot deregister dp-aware entries; the error says so.
        with pytest.raises(RouterStartError, match="dp-aware entries"):
            handle.remove_worker(worker.url, timeout_s=1.5)


def _tagged(port: int) -> Any:
    def generate(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "text": "",
            "output_ids": [],
            "meta_info": {"worker": port, "completion_tokens": 0, "output_token_logprobs": []},
        }

    return generate


def test_routing_key_stickiness(router: RouterHandle) -> None:
    a, b = LoopbackWorker(), LoopbackWorker()
    a.generate, b.generate = _tagged(a.port), _tagged(b.port)
    with a, b:
        router.add_worker(a.url)
        router.add_worker(b.url)
        try:
            served: dict[str, set[int]] = defaultdict(set)
            lock = threading.Lock()

            def drive(key: str) -> None:
                with httpx.Client(timeout=10) as client:
                    for _ in range(4):
                        r = client.post(
                            f"{router.url}/generate",
                            json={"input_ids": [1]},
                            headers={"X-SMG-Routing-Key": key},
                        )
                        with lock:
                            served[key].add(r.json()["meta_info"]["worker"])

            threads = [threading.Thread(target=drive, args=(f"key-{i}",)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)
            assert len(served) == 8
            assert all(len(ports) == 1 for ports in served.values()), served
        finally:
            router.remove_worker(a.url)
            router.remove_worker(b.url)


def test_passthrough_probe_positive_and_negative(router: RouterHandle) -> None:
    router.probe_passthrough()
    body = default_probe_body()
    body.update(return_routed_experts=True, routed_experts_start_len=3)
    with pytest.raises(RouterIncompatible) as info:
        router.probe_passthrough(body)
    assert info.value.dropped == ["return_routed_experts", "routed_experts_start_len"]
    assert "return_routed_experts" in str(info.value)
    assert router.workers() == []


def test_probe_on_a_live_router_leaves_real_workers_alone(router: RouterHandle) -> None:
    with LoopbackWorker() as real:
        real.generate = _tagged(real.port)
        router.add_worker(real.url)
        try:
            router.probe_passthrough()
            assert router.workers() == [real.url]
            # The echo worker is gone: ordinary traffic reaches the real worker.
            r = httpx.post(
                f"{router.url}/generate",
                json={"input_ids": [1]},
                headers={"X-SMG-Routing-Key": "k"},
                timeout=10,
            )
            assert r.status_code == 200
            assert r.json()["meta_info"]["worker"] == real.port
        finally:
            router.remove_worker(real.url)


_SLOW_WORKER = """
import sys, time
from posttrain.session_router import ChatTokenizer, LoopbackWorker
tok = ChatTokenizer.from_dir(sys.argv[2])
stop = tok.tokenizer.token_to_id("<|im_end|>")
def generate(body):
    if str(body.get("rid", "")).startswith("slow"):
        time.sleep(30)
    ids = tok.encode("reply from a") + [stop]
    return {"text": tok.decode(ids), "output_ids": ids, "meta_info": {
        "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids),
        "output_token_logprobs": [[-0.5, t, None] for t in ids], "finish_reason": {"type": "stop"}}}
LoopbackWorker(generate=generate, port=int(sys.argv[1])).start()
time.sleep(600)
"""


def test_worker_killed_mid_turn_is_502_and_retryable(
    router: RouterHandle, tok_dir: Path, chat_tok: Any, make_engine: Any, app_client: Any
) -> None:
    port = free_port()
    argv = [sys.executable, "-c", _SLOW_WORKER, str(port), str(tok_dir)]
    cfg = SessionRouterConfig(
        upstream_url=router.url, tokenizer=str(tok_dir), upstream_timeout_s=20
    )
    with (
        ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=30) as doomed,
        LoopbackWorker(generate=make_engine(chat_tok)) as spare,
    ):
        router.add_worker(f"http://127.0.0.1:{port}")

        async def scenario() -> None:
            async with app_client(cfg, tokenizer=chat_tok) as c:
                sid = (await c.post("/sessions")).json()["session_id"]
                url = f"/sessions/{sid}/v1/chat/completions"
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
                r1 = await c.post(url, json={"messages": msgs})
                assert r1.status_code == 200
                assert r1.json()["choices"][0]["message"]["content"] == "reply from a"
                await asyncio.to_thread(router.add_worker, spare.url)
                msgs = [
                    *msgs,
                    r1.json()["choices"][0]["message"],
                    {"role": "user", "content": "again"},
                ]
                loop = asyncio.get_running_loop()
                loop.call_later(0.5, os.kill, doomed.pid, signal.SIGKILL)
                r2 = await c.post(url, json={"messages": msgs, "rid": "slow-1"})
                assert r2.status_code == 502, r2.text
                assert len((await c.get(f"/sessions/{sid}")).json()["records"]) == 1
                # The launcher deregisters the dead worker; the same turn retried then succeeds.
                await asyncio.to_thread(router.remove_worker, f"http://127.0.0.1:{port}")
                r3 = await c.post(url, json={"messages": msgs})
                assert r3.status_code == 200, r3.text
                info = (await c.get(f"/sessions/{sid}")).json()
                assert len(info["records"]) == 2
                data = (await c.post(f"/sessions/{sid}/samples", json={})).content
                (sample,) = decode_samples(data).samples
                assert sample.tokens == info["metadata"]["accumulated_token_ids"]

        try:
            asyncio.run(asyncio.wait_for(scenario(), timeout=45))
        finally:
            router.remove_worker(spare.url)


def test_cli_probes_the_router_and_serves_with_a_bearer_token(
    router: RouterHandle, tok_dir: Path, chat_tok: Any, make_engine: Any
) -> None:
    port = free_port()
    argv = [
        sys.executable, "-m", "posttrain.session_router", "--upstream", router.url, "--tokenizer", str(tok_dir),
        "--lora-adapter", "miles_lora", "--host", "127.0.0.1", "--port", str(port), "--api-key", "k1",
        "--session-ttl-s", "60",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 40
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 401:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "session server did not start"
            time.sleep(0.1)
        with LoopbackWorker(generate=make_engine(chat_tok)) as worker:
            router.add_worker(worker.url)
            try:
                client = SessionClient(base, api_key="k1", timeout_s=10)
                sid = client.create(weight_version=3)
                with httpx.Client(headers={"authorization": "Bearer k1"}, timeout=10) as c:
                    # What an OpenAI SDK does with base_url: POST {base_url}/chat/completions.
                    r = c.post(
                        f"{client.base_url(sid)}/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}]},
                    )
                assert r.status_code == 200, r.text
                assert len(r.headers.get_list("server")) <= 1
                headers, body = worker.generate_requests[-1]
                assert body["lora_path"] == "miles_lora"
                assert body["extra_key"] == "miles_lora:v3"
                assert headers["x-smg-routing-key"] == sid
                assert "return_logprob" in body
                assert body["input_ids"] == client.get(sid)["records"][0]["request"]["input_ids"]
                # The raw proxy drops the worker's Server/Date headers (forwarded by the router):
                # uvicorn adds its own, and a duplicate Server header breaks some clients.
                with httpx.Client(headers={"authorization": "Bearer k1"}, timeout=10) as c:
                    raw = c.post(f"{base}/sessions/{sid}/generate", json={"input_ids": [1, 2]})
                assert raw.status_code == 200, raw.text
                assert len(raw.headers.get_list("server")) == 1
                assert len(raw.headers.get_list("date")) == 1
                proxied_headers, proxied = worker.generate_requests[-1]
                assert proxied["input_ids"] == [1, 2]
                assert (proxied["lora_path"], proxied["extra_key"]) == (
                    "miles_lora",
                    "miles_lora:v3",
                )
                assert proxied_headers["x-smg-routing-key"] == sid
                driver = Sample(
                    prompt_ids=[], response_ids=[], rollout_logprobs=[], loss_mask=[], index=5
                )
                (sample,) = client.collect(sid, base=driver, metadata={"k": 1}).samples
                assert sample.index == 5
                assert sample.metadata["k"] == 1
                assert sample.response_length > 0
                client.close(sid)
                with pytest.raises(SessionNotFoundError):
                    client.close(sid)
                client.shutdown()
            finally:
                router.remove_worker(worker.url)
    finally:
        stop_process_group(proc, grace_s=10)


def test_cli_refuses_a_router_that_drops_fields(
    router: RouterHandle,
    tok_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import posttrain.session_router.cli as cli

    # Ask for a field the stock router drops (R3 replay); the real router then fails the probe.
    original = cli.default_probe_body
    monkeypatch.setattr(
        cli, "default_probe_body", lambda cfg: {**original(cfg), "return_routed_experts": True}
    )
    code = cli.main(
        ["--upstream", router.url, "--tokenizer", str(tok_dir), "--port", str(free_port())]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "return_routed_experts" in err
    assert router.workers() == []


def test_sgl_router_admin_api_is_not_reachable_through_a_session(
    router: RouterHandle, tok_dir: Path, chat_tok: Any, make_engine: Any, app_client: Any
) -> None:
    """A session client cannot deregister engines or register a worker URL (issue #18)."""
    cfg = SessionRouterConfig(upstream_url=router.url, tokenizer=str(tok_dir))
    with LoopbackWorker(generate=make_engine(chat_tok)) as worker:
        router.add_worker(worker.url)
        try:
            (entry,) = router.list_workers()

            async def scenario() -> None:
                async with app_client(cfg, tokenizer=chat_tok) as c:
                    sid = (await c.post("/sessions")).json()["session_id"]
                    url = f"/sessions/{sid}/v1/chat/completions"
                    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
                    r1 = await c.post(url, json={"messages": msgs})
                    assert r1.status_code == 200, r1.text
                    gone = await c.delete(f"/sessions/{sid}/workers/{entry['id']}")
                    assert gone.status_code == 404, gone.text
                    added = await c.post(
                        f"/sessions/{sid}/workers", json={"url": "http://127.0.0.1:9"}
                    )
                    assert added.status_code == 404, added.text
                    listed = await c.get(f"/sessions/{sid}/workers")
                    assert listed.status_code == 404
                    flushed = await c.post(f"/sessions/{sid}/flush_cache")
                    assert flushed.status_code == 404
                    # read-only information still passes through
                    models = await c.get(f"/sessions/{sid}/v1/models")
                    assert models.status_code == 200, models.text
                    msgs = [
                        *msgs,
                        r1.json()["choices"][0]["message"],
                        {"role": "user", "content": "again"},
                    ]
                    r2 = await c.post(url, json={"messages": msgs})
                    assert r2.status_code == 200, r2.text

            asyncio.run(asyncio.wait_for(scenario(), timeout=45))
            assert router.workers() == [worker.url]  # still registered, nothing added
        finally:
            router.remove_worker(worker.url)


def test_cli_names_an_upstream_it_cannot_reach_and_a_bad_port(
    tok_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import posttrain.session_router.cli as cli

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = cli.main(["--upstream", dead, "--tokenizer", str(tok_dir), "--port", str(free_port())])
    assert code == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"error: --upstream {dead}: ConnectError: ")
    code = cli.main(["--upstream", dead, "--tokenizer", str(tok_dir), "--port", "70000"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "error: --port 70000 is not a TCP port (0-65535)"
