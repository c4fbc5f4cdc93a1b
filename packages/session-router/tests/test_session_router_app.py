"""The ASGI session server against an ``httpx.MockTransport`` upstream: routes, faults, limits."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from posttrain.formats import decode_samples
from posttrain.interface import ConfigError, RolloutEngine, SampleStatus, TransportError
from posttrain.session_router import (
    ChatTokenizer,
    SessionRolloutClient,
    create_app,
)


class _DeletesFail(httpx.AsyncBaseTransport):
    """Passes every request to ``inner`` but DELETE, which fails to connect."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_three_turns_then_samples(run_app: Any) -> None:
    seen: list[httpx.Request] = []

    async def scenario(c: httpx.AsyncClient) -> None:
        assert (await c.get("/health")).json()["status"] == "ok"
        # The adapter is served, so a session must say which version its requests name.
        refused = await c.post("/sessions")
        assert refused.status_code == 400
        assert "a weight version is required" in refused.json()["error"]
        bad = await c.post("/sessions", json={"weight_version": "4"})
        assert bad.status_code == 400
        sid = (await c.post("/sessions", json={"weight_version": 4})).json()["session_id"]
        msgs: list[dict[str, Any]] = [user("hello")]
        for turn in range(3):
            r = await c.post(
                f"/sessions/{sid}/v1/chat/completions",
                json={"model": "m", "messages": msgs, "max_tokens": 32, "logprobs": True},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            choice = body["choices"][0]
            assert choice["finish_reason"] == "stop"
            assert choice["message"]["content"].startswith("reply")
            assert len(choice["logprobs"]["content"]) == body["usage"]["completion_tokens"]
            assert "server" not in r.headers
            msgs = [*msgs, choice["message"], user(f"more {turn}")]
        for req in seen:
            sent = json.loads(req.content)
            assert req.headers["x-smg-routing-key"] == sid
            assert sent["lora_path"] == "miles_lora"
            assert sent["extra_key"] == "miles_lora:v4"
            assert sent["return_logprob"] is True
        info = (await c.get(f"/sessions/{sid}")).json()
        assert info["metadata"]["weight_version"] == 4
        assert len(info["records"]) == 3
        assert info["metadata"]["max_trim_tokens"] == 1
        acc = info["metadata"]["accumulated_token_ids"]
        r = await c.post(
            f"/sessions/{sid}/samples", json={"max_seq_len": None, "metadata": {"run": 1}}
        )
        assert r.headers["content-type"] == "application/octet-stream"
        (sample,) = decode_samples(r.content).samples
        assert sample.tokens == acc
        assert sample.weight_version == 7  # what the engine reported (SGLang's "7")
        assert sample.metadata["run"] == 1
        # Every trained token carries exactly the logprob the engine reported for it.
        engine_lp = {}
        for record in info["records"]:
            prompt = record["request"]["input_ids"]
            for j, (lp, tid, _) in enumerate(
                record["response"]["meta_info"]["output_token_logprobs"]
            ):
                engine_lp[len(prompt) + j] = (tid, lp)
        for pos, m in enumerate(sample.loss_mask):
            if m:
                assert engine_lp[len(sample.prompt_ids) + pos] == (
                    sample.response_ids[pos],
                    sample.rollout_logprobs[pos],
                )
        assert sum(sample.loss_mask) == sum(
            len(r["response"]["output_ids"]) for r in info["records"]
        )
        assert (await c.delete(f"/sessions/{sid}")).status_code == 204
        assert (await c.delete(f"/sessions/{sid}")).status_code == 404
        metrics = (await c.get("/metrics")).text
        assert 'session_router_turns_total{outcome="committed"} 3.0' in metrics

    run_app(scenario, seen=seen, lora_adapter="miles_lora")


def test_stream_is_one_sse_chunk_then_done(run_app: Any) -> None:
    seen: list[httpx.Request] = []

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        r = await c.post(
            f"/sessions/{sid}/v1/chat/completions", json={"messages": [user("hi")], "stream": True}
        )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        events = [e for e in r.text.split("\n\n") if e]
        assert len(events) == 2
        assert events[1] == "data: [DONE]"
        chunk = json.loads(events[0].removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["choices"][0]["delta"]["role"] == "assistant"
        assert chunk["choices"][0]["finish_reason"] == "stop"
        assert chunk["usage"]["completion_tokens"] > 0
        assert "stream" not in json.loads(seen[0].content)
        assert "lora_path" not in json.loads(seen[0].content)
        assert "extra_key" not in json.loads(seen[0].content)

    run_app(scenario, seen=seen)


def test_client_errors(run_app: Any) -> None:
    async def scenario(c: httpx.AsyncClient) -> None:
        assert (await c.get("/sessions/nope")).status_code == 404
        r = await c.post("/sessions/nope/v1/chat/completions", json={"messages": [user("x")]})
        assert r.status_code == 404
        assert "nope" in r.json()["error"]
        sid = (await c.post("/sessions")).json()["session_id"]
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", content=b"{oops")
        assert r.status_code == 400
        assert r.json()["error"].startswith("invalid JSON body")
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", content=b"x" * 5000)
        assert r.status_code == 413
        r = await c.post(f"/sessions/{sid}/samples", json={"max_seq_len": "big"})
        assert r.status_code == 400
        empty = decode_samples((await c.post(f"/sessions/{sid}/samples", json={})).content)
        assert empty.samples == []
        assert empty.empty_reason == "no_records"

    run_app(scenario, max_body_bytes=4096)


def test_bearer_token_guards_every_route(run_app: Any) -> None:
    async def scenario(c: httpx.AsyncClient) -> None:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("POST", "/sessions"),
            ("GET", "/sessions/x"),
            ("POST", "/sessions/x/v1/chat/completions"),
        ]:
            assert (await c.request(method, path)).status_code == 401
            assert (
                await c.request(method, path, headers={"authorization": "Bearer wrong"})
            ).status_code == 401
        ok = {"authorization": "Bearer s3cret"}
        assert (await c.get("/health", headers=ok)).status_code == 200
        assert (await c.post("/sessions", headers=ok)).status_code == 200

    run_app(scenario, api_key="s3cret")


def test_transport_failure_is_502_and_the_turn_is_retryable(
    chat_tok: ChatTokenizer, make_engine: Any, run_app: Any
) -> None:
    engine = make_engine(chat_tok)
    state = {"fail": 1, "bad": 1, "status": 2}

    async def upstream(request: httpx.Request) -> httpx.Response:
        if state["fail"]:
            state["fail"] -= 1
            raise httpx.ConnectError("worker went away", request=request)
        if state["bad"]:
            state["bad"] -= 1
            return httpx.Response(200, json={"text": "x"})
        if state["status"]:
            state["status"] -= 1
            return httpx.Response(503 if state["status"] else 400, json={"error": "too long"})
        return httpx.Response(200, json=engine(json.loads(request.content)))

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        url = f"/sessions/{sid}/v1/chat/completions"
        body = {"messages": [user("hi")]}
        r = await c.post(url, json=body)
        assert r.status_code == 502
        assert r.json()["error"] == "backend transport error: ConnectError: worker went away"
        r = await c.post(url, json=body)
        assert r.status_code == 502
        assert "meta_info" in r.json()["error"]
        r = await c.post(url, json=body)
        assert r.status_code == 502
        assert r.json()["error"].startswith("upstream answered 503")
        r = await c.post(url, json=body)
        assert r.status_code == 400
        assert r.json() == {"error": "too long"}
        assert (await c.get(f"/sessions/{sid}")).json()["records"] == []
        r = await c.post(url, json=body)
        assert r.status_code == 200
        assert len((await c.get(f"/sessions/{sid}")).json()["records"]) == 1

    run_app(scenario, upstream=upstream)


def test_delete_racing_a_chat(chat_tok: ChatTokenizer, make_engine: Any, run_app: Any) -> None:
    engine = make_engine(chat_tok)
    entered, release = asyncio.Event(), asyncio.Event()

    async def upstream(request: httpx.Request) -> httpx.Response:
        entered.set()
        await release.wait()
        return httpx.Response(200, json=engine(json.loads(request.content)))

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        chat = asyncio.create_task(
            c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [user("hi")]})
        )
        await asyncio.wait_for(entered.wait(), 5)
        # The lock is not held across the upstream call, so DELETE does not wait for the engine.
        assert (await asyncio.wait_for(c.delete(f"/sessions/{sid}"), 5)).status_code == 204
        release.set()
        reply = await asyncio.wait_for(chat, 5)
        assert reply.status_code == 200  # the agent gets its answer; nothing is recorded
        assert (await c.get(f"/sessions/{sid}")).status_code == 404
        assert 'outcome="not_committed"' in (await c.get("/metrics")).text

    run_app(scenario, upstream=upstream)


def test_ttl_reclaims_abandoned_sessions(run_app: Any) -> None:
    async def scenario(c: httpx.AsyncClient) -> None:
        a = (await c.post("/sessions")).json()["session_id"]
        b = (await c.post("/sessions")).json()["session_id"]
        for _ in range(4):  # keep b alive, let a expire
            await asyncio.sleep(0.1)
            assert (await c.get(f"/sessions/{b}")).status_code == 200
        assert (await c.get(f"/sessions/{a}")).status_code == 404
        await asyncio.sleep(0.6)  # the reaper reclaims b without any access
        assert b not in c._transport.app.state.server.sessions  # type: ignore[attr-defined]
        assert "session_router_sessions_expired_total 2.0" in (await c.get("/metrics")).text

    run_app(scenario, session_ttl_s=0.25)


def test_raw_proxy_adds_routing_key_and_gates_lora(run_app: Any) -> None:
    seen: list[httpx.Request] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200, json={"ok": True}, headers={"server": "upstream", "x-extra": "1"}
        )

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]  # the server's version, 9
        r = await c.post(
            f"/sessions/{sid}/generate?x=1",
            json={"input_ids": [1], "lora_path": "other", "extra_key": "other:v1"},
        )
        assert r.status_code == 200
        assert r.headers["x-extra"] == "1"
        assert "server" not in r.headers
        r = await c.get(f"/sessions/{sid}/get_model_info")
        assert r.status_code == 200
        assert seen[0].url.path == "/generate"
        assert seen[0].url.query == b"x=1"
        sent = json.loads(seen[0].content)
        assert (sent["lora_path"], sent["extra_key"]) == ("miles_lora", "miles_lora:v9")
        assert seen[0].headers["x-smg-routing-key"] == sid
        assert seen[1].url.path == "/get_model_info"
        assert (await c.get(f"/sessions/{sid}")).json()["records"] == []

    run_app(scenario, upstream=upstream, lora_adapter="miles_lora", lora_weight_version=9)


def test_rollout_client_is_a_rollout_engine_one_session_per_rollout(
    chat_tok: ChatTokenizer, make_engine: Any, router_config: Any
) -> None:
    seen: list[httpx.Request] = []
    engine = make_engine(chat_tok)
    failing = {"left": 0}

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if failing["left"]:
            failing["left"] -= 1
            return httpx.Response(400, json={"error": "prompt too long"})
        return httpx.Response(200, json=engine(json.loads(request.content)))

    async def main() -> None:
        cfg = router_config(lora_adapter="miles_lora")
        app = create_app(cfg, tokenizer=chat_tok, transport=httpx.MockTransport(upstream))
        server = app.state.server
        try:
            async with SessionRolloutClient(
                "http://sr", transport=httpx.ASGITransport(app=app)
            ) as client:
                assert isinstance(client, RolloutEngine)
                group = await client.rollout_group(
                    [user("hi")], 3, group_index=2, sampling_params={"max_tokens": 8},
                    weight_version=6,
                )  # fmt: skip
                assert [(s.group_index, s.index) for s in group] == [(2, 0), (2, 1), (2, 2)]
                for sample in group:
                    assert sample.response_length > 0
                    assert sample.loss_mask == [1] * sample.response_length
                    assert sample.weight_version == 7  # the engine's (SGLang's "7")
                assert {json.loads(r.content)["extra_key"] for r in seen} == {"miles_lora:v6"}
                assert server.sessions == {}  # every session was deleted
                # A failed turn raises and still deletes its session.
                failing["left"] = 1
                with pytest.raises(TransportError, match="answered 400"):
                    await client.rollout([user("hi")], weight_version=6)
                assert server.sessions == {}
                # A delete that fails as well does not hide why the turn failed.
                failing["left"] = 1
                async with SessionRolloutClient(
                    "http://sr", transport=_DeletesFail(httpx.ASGITransport(app=app))
                ) as flaky:
                    with pytest.raises(TransportError, match="answered 400"):
                        await flaky.rollout([user("hi")], weight_version=6)
                server.sessions.clear()  # the session that delete could not remove
                # Serving an adapter without a version: refused when the session is created.
                with pytest.raises(TransportError, match="a weight version is required"):
                    await client.rollout([user("hi")])
        finally:
            await server.aclose()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_turn_past_turn_timeout_s_is_an_aborted_sample_not_an_error(
    chat_tok: ChatTokenizer, make_engine: Any, router_config: Any
) -> None:
    engine = make_engine(chat_tok)
    mode = {"now": "hang"}

    async def upstream(request: httpx.Request) -> httpx.Response:
        if mode["now"] == "hang":  # an engine that froze: no reply (bounded, for the test)
            await asyncio.sleep(30)
        if mode["now"] == "timeout":  # the session server's own upstream deadline passed
            raise httpx.ReadTimeout("no reply", request=request)
        return httpx.Response(200, json=engine(json.loads(request.content)))

    async def main() -> None:
        app = create_app(
            router_config(), tokenizer=chat_tok, transport=httpx.MockTransport(upstream)
        )
        server = app.state.server
        asgi = httpx.ASGITransport(app=app)
        try:
            async with SessionRolloutClient(
                "http://sr", turn_timeout_s=0.2, transport=asgi
            ) as client:
                # The client's own deadline: no tokens, the reason, the session deleted.
                sample = await client.rollout([user("hi")], metadata={"prompt_index": 4})
                assert sample.status is SampleStatus.ABORTED
                assert sample.response_ids == sample.prompt_ids == sample.loss_mask == []
                assert "no reply within turn_timeout_s=0.2 s" in sample.metadata["abort_reason"]
                assert sample.metadata["prompt_index"] == 4
                assert sample.metadata["session_id"]
                assert server.sessions == {}
                # The session server's 504 (its upstream_timeout_s) is the same abort.
                mode["now"] = "timeout"
                sample = await client.rollout([user("hi")])
                assert sample.status is SampleStatus.ABORTED
                assert "(504)" in sample.metadata["abort_reason"]
                assert server.sessions == {}
                # An answered turn is a completed sample that names its session.
                mode["now"] = "answer"
                sample = await client.rollout([user("hi")])
                assert sample.status is SampleStatus.COMPLETED
                assert sample.response_length > 0
                assert sample.metadata["session_id"]
            # Without turn_timeout_s a timeout is an error, as before.
            mode["now"] = "timeout"
            async with SessionRolloutClient("http://sr", transport=asgi) as strict:
                with pytest.raises(TransportError, match="answered 504"):
                    await strict.rollout([user("hi")])
            assert server.sessions == {}
        finally:
            await server.aclose()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_turn_timeout_s_must_be_a_finite_positive_number(bad: Any) -> None:
    with pytest.raises(ConfigError, match="turn_timeout_s"):
        SessionRolloutClient("http://sr", turn_timeout_s=bad)
