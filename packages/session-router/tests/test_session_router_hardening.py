"""Hostile and broken inputs (issue #18): bad message shapes, a template that crashes, a frozen
upstream, a client that leaves mid-turn, and a fuzzed chat body. Each answer is JSON naming what
is wrong, and nothing a failed or abandoned turn did is committed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.interface.testing import AppServer
from posttrain.session_router import (
    BadChatRequestError,
    ChatTokenizer,
    LoopbackWorker,
    SessionRouterConfig,
    build_generate_body,
    create_app,
    parse_chat_body,
)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


BAD_MESSAGES: list[tuple[Any, str]] = [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "wizard", "content": "abracadabra"}], "messages[0].role"),
    ([{"role": None, "content": "x"}], "messages[0].role"),
    ([user("hi"), "not a message"], "messages[1]"),
    ([{"role": "user", "content": 7}], "messages[0].content"),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        "messages[0].content",
    ),
    ([{"role": "assistant", "content": None}], "messages[0].content"),
    ([{"role": "assistant", "content": "x", "tool_calls": "call"}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": 1}]}], "tool_calls[0]"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
    ([{"role": "tool", "content": "x", "tool_call_id": ["a"]}], "messages[0].tool_call_id"),
]


@pytest.mark.parametrize(("messages", "field"), BAD_MESSAGES)
def test_bad_message_shapes_are_400_naming_the_field(
    messages: Any, field: str, run_app: Any
) -> None:
    seen: list[httpx.Request] = []

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == "application/json"
        assert field in r.json()["error"]
        assert (await c.get(f"/sessions/{sid}")).json()["records"] == []
        # the session is intact: a good turn still works
        ok = await c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [user("hi")]})
        assert ok.status_code == 200, ok.text

    run_app(scenario, seen=seen)
    assert len(seen) == 1  # the bad turn never reached the upstream


def test_assistant_tool_call_may_leave_content_null() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = parse_chat_body(
        json.dumps(
            {
                "messages": [
                    user("hi"),
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                ]
            }
        ).encode()
    )
    assert req.messages[1]["content"] is None


def test_a_template_that_breaks_on_a_value_is_a_400_not_a_500(
    tmp_path: Path, chat_tok: ChatTokenizer, run_app: Any
) -> None:
    # A template that does arithmetic on a message field (a real template concatenates content
    # without checking it): the request's value makes it raise TypeError inside jinja.
    tok = ChatTokenizer(
        chat_tok.tokenizer,
        "{% for m in messages %}{{ m['content'] + m.get('weight', 0) }}{% endfor %}",
        source="breaking-template",
    )

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        msgs = [{"role": "user", "content": "hi", "weight": 3}]
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": msgs})
        assert r.status_code == 400, r.text
        assert "breaking-template" in r.json()["error"]
        assert "TypeError" in r.json()["error"]

    run_app(scenario, tokenizer=tok)


def test_an_unexpected_exception_is_a_json_500(run_app: Any) -> None:
    async def upstream(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug in the upstream client")

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        r = await c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [user("x")]})
        assert r.status_code == 500
        assert r.headers["content-type"] == "application/json"
        assert "RuntimeError" in r.json()["error"]
        assert (await c.get(f"/sessions/{sid}")).json()["records"] == []

    run_app(scenario, upstream=upstream)


def test_admin_routes_are_not_proxied(run_app: Any) -> None:
    seen: list[httpx.Request] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json={"status": "accepted"})

    async def scenario(c: httpx.AsyncClient) -> None:
        sid = (await c.post("/sessions")).json()["session_id"]
        for method, path in [
            ("DELETE", "workers/abc"),
            ("POST", "workers"),
            ("GET", "workers"),
            ("POST", "flush_cache"),
            ("POST", "update_weights_from_disk"),
            ("POST", "load_lora_adapter"),
            ("POST", "add_worker"),
            ("POST", "remove_worker"),
            ("GET", "../health"),
        ]:
            r = await c.request(method, f"/sessions/{sid}/{path}", json={"url": "http://x"})
            assert r.status_code == 404, (method, path, r.text)
            assert "error" in r.json()
        # v1/completions is the session server's own raw-prompt turn, never a raw proxy: a body
        # without a prompt is its 400, and nothing goes upstream
        r = await c.post(f"/sessions/{sid}/v1/completions", json={"url": "http://x"})
        assert r.status_code == 400
        assert "prompt: must be a non-empty text or list of token ids" in r.json()["error"]
        # an allow-listed route with another method is 405, never forwarded either
        r = await c.delete(f"/sessions/{sid}/generate")
        assert r.status_code == 405
        assert (await c.get(f"/sessions/{sid}/v1/models")).status_code == 202
        assert (await c.get(f"/sessions/{sid}/get_server_info")).status_code == 202

    run_app(scenario, upstream=upstream)
    assert [(r.method, r.url.path) for r in seen] == [
        ("GET", "/v1/models"),
        ("GET", "/get_server_info"),
    ]


@contextlib.contextmanager
def _silent_upstream() -> Iterator[str]:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a frozen engine)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(sock.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        sock.close()


def test_a_silent_upstream_fails_the_turn_with_504(
    tok_dir: Path, chat_tok: ChatTokenizer, app_client: Any
) -> None:
    with _silent_upstream() as url:
        cfg = SessionRouterConfig(upstream_url=url, tokenizer=str(tok_dir), upstream_timeout_s=0.5)

        async def main() -> None:
            # the default (pooled) upstream client
            async with app_client(cfg, tokenizer=chat_tok) as c:
                sid = (await c.post("/sessions")).json()["session_id"]
                r = await c.post(
                    f"/sessions/{sid}/v1/chat/completions", json={"messages": [user("hi")]}
                )
                assert r.status_code == 504, r.text
                assert url in r.json()["error"]
                assert "0.5 s" in r.json()["error"]
                assert (await c.get(f"/sessions/{sid}")).json()["records"] == []
                # the raw proxy is bounded by the same timeout
                raw = await c.get(f"/sessions/{sid}/health")
                assert raw.status_code == 504
                metrics = (await c.get("/metrics")).text
                assert 'session_router_turns_total{outcome="upstream_error"}' not in metrics

        asyncio.run(asyncio.wait_for(main(), timeout=30))


def _wait_for(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_turn_the_client_abandoned_is_not_committed(
    tok_dir: Path, chat_tok: ChatTokenizer, make_engine: Any
) -> None:
    release = threading.Event()
    engine = make_engine(chat_tok)

    def generate(body: dict[str, Any]) -> dict[str, Any]:
        if body.get("rid") == "slow":
            release.wait(timeout=20)
        return engine(body)

    with LoopbackWorker(generate=generate) as worker:
        cfg = SessionRouterConfig(upstream_url=worker.url, tokenizer=str(tok_dir))
        # real sockets under uvicorn, so the client's disconnect is a real one
        with AppServer(create_app(cfg, tokenizer=chat_tok), http="httptools") as server:
            base = server.url
            sid = httpx.post(f"{base}/sessions", timeout=10).json()["session_id"]
            url = f"/sessions/{sid}/v1/chat/completions"
            body = json.dumps({"messages": [user("hi")], "rid": "slow"}).encode()
            client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
            client.sendall(
                f"POST {url} HTTP/1.1\r\nHost: sr\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            _wait_for(lambda: len(worker.generate_requests) == 1, "the upstream call")
            client.close()  # the agent gives up before the reply
            _wait_for(
                lambda: not server.server.server_state.connections,
                "the server to see the disconnect",
            )
            release.set()

            def abandoned() -> bool:
                text = httpx.get(f"{base}/metrics", timeout=10).text
                return 'session_router_turns_total{outcome="abandoned"} 1.0' in text

            _wait_for(abandoned, "the abandoned turn")
            info = httpx.get(f"{base}/sessions/{sid}", timeout=10).json()
            assert info["records"] == []
            assert info["metadata"]["accumulated_token_ids"] == []
            # the agent's retry of the same turn is the session's first committed turn
            r = httpx.post(f"{base}{url}", json={"messages": [user("hi")]}, timeout=10)
            assert r.status_code == 200, r.text
            assert len(httpx.get(f"{base}/sessions/{sid}", timeout=10).json()["records"]) == 1


# ---- fuzzing the chat body parser (untrusted bytes) ----------------------------------------

_json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_json = st.recursive(
    _json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "wizard", 3, None])},
    optional={
        "content": _json_scalars | st.lists(_json, max_size=3),
        "tool_calls": _json,
        "name": _json_scalars,
        "tool_call_id": _json_scalars,
    },
)
_body = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(_message, max_size=4) | _json,
        "tools": _json,
        "n": _json_scalars,
        "stream": _json_scalars,
        "chat_template_kwargs": _json,
        "sampling_params": _json,
        "max_tokens": _json_scalars,
        "top_logprobs": _json_scalars,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()))
def test_fuzz_arbitrary_bytes_parse_or_400(raw: bytes) -> None:
    with contextlib.suppress(BadChatRequestError):
        req = parse_chat_body(raw)
        assert isinstance(req.messages, list)
        assert req.messages


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_body)
def test_fuzz_chat_bodies_render_or_400(body: dict[str, Any], chat_tok: ChatTokenizer) -> None:
    cfg = SessionRouterConfig(upstream_url="http://router.test", tokenizer="unused")
    try:
        req = parse_chat_body(json.dumps(body).encode())
        text = chat_tok.render(
            req.messages,
            add_generation_prompt=True,
            tools=req.tools,
            template_kwargs=req.template_kwargs,
        )
        out = build_generate_body(req.body, cfg, chat_tok.encode(text))
    except BadChatRequestError:
        return
    assert out["input_ids"] == chat_tok.encode(text)
    assert "stream" not in out


def test_help_names_every_option_with_its_default() -> None:
    from posttrain.session_router.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, action.option_strings
    for flag, default in [
        ("--upstream-timeout-s", "120.0"),
        ("--session-ttl-s", "3600.0"),
        ("--port", "8080"),
        ("--host", "127.0.0.1"),
        ("--allocator", "mimalloc"),
    ]:
        assert flag in text
        assert f"(default: {default})" in " ".join(text.split())
    args = parser.parse_args(["--upstream", "http://r", "--tokenizer", "t"])
    assert args.upstream_timeout_s == 120.0
    assert parser.parse_args(
        ["--upstream", "http://r", "--tokenizer", "t", "--upstream-timeout-s", "inf"]
    ).upstream_timeout_s == float("inf")
