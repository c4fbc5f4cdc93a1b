"""The default upstream client (``PooledUpstream``) against real sockets on 127.0.0.1.

Each scripted server is an asyncio server in the test's own loop that answers with exact bytes,
so keep-alive reuse, chunked and EOF-delimited bodies, an idle connection closed by the peer,
timeouts, malformed and oversize replies, and the connection bound are all caused for real.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import pytest

from posttrain.interface import ConfigError
from posttrain.session_router import (
    LoopbackWorker,
    PooledUpstream,
    UpstreamTransportError,
)

Reply = Callable[[bytes, int], Awaitable[bytes | None]]  # (request bytes, conn number) -> reply


class ScriptedServer:
    """Parses requests with httptools and answers each with ``reply(request, connection_no)``.

    ``None`` from ``reply`` closes the connection without answering; ``close_after`` closes it
    after every reply (without saying ``Connection: close``).
    """

    def __init__(self, reply: Reply, *, close_after: bool = False) -> None:
        self.reply = reply
        self.close_after = close_after
        self.connections = 0
        self.open_now = 0
        self.max_open = 0
        self.requests: list[tuple[bytes, dict[str, str], bytes]] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        done: list[tuple[bytes, dict[str, str], bytes]] = []

        class Sink:
            def __init__(self) -> None:
                self.headers: dict[str, str] = {}
                self.body = b""
                self.url = b""

            def on_url(self, url: bytes) -> None:
                self.url += url

            def on_header(self, name: bytes, value: bytes) -> None:
                self.headers[name.decode().lower()] = value.decode()

            def on_body(self, body: bytes) -> None:
                self.body += body

            def on_message_complete(self) -> None:
                done.append((self.url, self.headers, self.body))
                self.__init__()  # type: ignore[misc]

        sink = Sink()
        parser = httptools.HttpRequestParser(sink)
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                parser.feed_data(data)
                while done:
                    request = done.pop(0)
                    self.requests.append(request)
                    answer = await self.reply(request[2], number)
                    if answer is None:
                        return
                    writer.write(answer)
                    await writer.drain()
                    if self.close_after:
                        return
        finally:
            self.open_now -= 1
            writer.close()


def ok(body: bytes = b'{"ok":true}') -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # type: ignore[arg-type]


def client(url: str, **kw: Any) -> PooledUpstream:
    return PooledUpstream(url, **{"timeout_s": 5.0, "max_connections": 8, **kw})


def test_round_trip_sends_exact_bytes_and_reuses_one_connection() -> None:
    async def reply(body: bytes, _: int) -> bytes:
        return ok(b"echo:" + body)

    async def main() -> None:
        server = ScriptedServer(reply)
        async with server as url:
            up = client(url)
            for i in range(5):
                r = await up.request(
                    "POST",
                    "/generate",
                    content=b'{"i":%d}' % i,
                    headers={"X-SMG-Routing-Key": "s1", "content-type": "application/json"},
                    query="a=1&b=2",
                )
                assert r.status_code == 200
                assert r.content == b'echo:{"i":%d}' % i
                assert r.url == f"{url}/generate?a=1&b=2"
            await up.aclose()
        assert server.connections == 1  # keep-alive: one connection for all five
        url_path, headers, _ = server.requests[0]
        assert url_path == b"/generate?a=1&b=2"
        assert headers["x-smg-routing-key"] == "s1"
        assert headers["content-length"] == str(len(b'{"i":0}'))
        assert "user-agent" not in headers
        assert "accept-encoding" not in headers

    run(main())


def test_chunked_and_eof_delimited_bodies_are_read_whole() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    until_eof = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nthe whole rest"

    async def reply(body: bytes, _: int) -> bytes:
        return chunked if body == b"chunked" else until_eof

    async def main() -> None:
        server = ScriptedServer(reply, close_after=True)
        async with server as url:
            up = client(url)
            r = await up.request("POST", "/x", content=b"chunked", headers={})
            assert r.content == b"hello world"
            assert ("transfer-encoding", "chunked") in r.headers
            r = await up.request("POST", "/x", content=b"eof", headers={})
            assert r.content == b"the whole rest"
            await up.aclose()

    run(main())


def test_an_idle_connection_closed_by_the_upstream_is_retried_once_on_a_new_one() -> None:
    async def reply(body: bytes, _: int) -> bytes:
        return ok(body)

    async def main() -> None:
        # The server closes after each reply without "Connection: close": the pooled connection
        # looks reusable, and the next request meets EOF before any reply byte.
        server = ScriptedServer(reply, close_after=True)
        async with server as url:
            up = client(url)
            for i in range(3):
                r = await up.request("POST", "/x", content=b"%d" % i, headers={})
                assert r.content == b"%d" % i
                await asyncio.sleep(0.05)  # let the close reach us while the connection idles
            await up.aclose()
        assert server.connections == 3
        assert [body for _, _, body in server.requests] == [b"0", b"1", b"2"]  # none sent twice

    run(main())


def test_a_connection_dropped_mid_request_is_a_transport_error_not_a_retry() -> None:
    async def reply(body: bytes, number: int) -> bytes | None:
        return None  # read the request, then hang up without answering

    async def main() -> None:
        server = ScriptedServer(reply)
        async with server as url:
            up = client(url)
            with pytest.raises(UpstreamTransportError) as err:
                await up.request("POST", "/generate", content=b"x", headers={})
            assert err.value.url == f"{url}/generate"
            assert err.value.cause_name == "ConnectionResetError"
            await up.aclose()
        assert len(server.requests) == 1  # a fresh connection is never retried

    run(main())


def test_refused_connection_names_the_url() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        up = client(f"http://127.0.0.1:{port}")
        with pytest.raises(UpstreamTransportError) as err:
            await up.request("GET", "/health", content=b"", headers={})
        assert err.value.url == f"http://127.0.0.1:{port}/health"
        assert "ConnectionRefusedError" in str(err.value)
        await up.aclose()

    run(main())


def test_timeout_is_finite_and_the_timed_out_connection_is_not_reused() -> None:
    async def reply(body: bytes, _: int) -> bytes:
        if body == b"slow":
            await asyncio.sleep(2)
        return ok(body)

    async def main() -> None:
        server = ScriptedServer(reply)
        async with server as url:
            up = client(url, timeout_s=0.2)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(UpstreamTransportError) as err:
                await up.request("POST", "/x", content=b"slow", headers={})
            assert err.value.cause_name == "TimeoutError"
            assert loop.time() - started < 1.5
            r = await up.request("POST", "/x", content=b"fast", headers={})
            assert r.content == b"fast"  # not the slow request's late reply
            await up.aclose()
        assert server.connections == 2

    run(main())


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", "HttpParserError"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000, "ValueError"),
    ],
    ids=["malformed", "oversize"],
)
def test_malformed_and_oversize_replies_are_transport_errors(answer: bytes, cause: str) -> None:
    async def reply(body: bytes, _: int) -> bytes:
        return answer

    async def main() -> None:
        async with ScriptedServer(reply) as url:
            up = client(url, max_reply_bytes=1000)
            with pytest.raises(UpstreamTransportError) as err:
                await up.request("POST", "/x", content=b"x", headers={})
            assert err.value.cause_name == cause
            await up.aclose()

    run(main())


def test_in_flight_connections_never_exceed_max_connections() -> None:
    async def reply(body: bytes, _: int) -> bytes:
        await asyncio.sleep(0.05)
        return ok(body)

    async def main() -> None:
        server = ScriptedServer(reply)
        async with server as url:
            up = client(url, max_connections=2)
            replies = await asyncio.gather(
                *(up.request("POST", "/x", content=b"%d" % i, headers={}) for i in range(8))
            )
            assert [r.content for r in replies] == [b"%d" % i for i in range(8)]
            await up.aclose()
        assert server.max_open <= 2
        assert server.connections == 2

    run(main())


def test_against_the_loopback_worker_the_routing_key_and_body_arrive() -> None:
    async def main() -> None:
        with LoopbackWorker(generate=lambda body: {"text": "ok", "seen": body}) as worker:
            up = client(worker.url)
            r = await up.request(
                "POST",
                "/generate",
                content=b'{"input_ids":[1,2,3]}',
                headers={"X-SMG-Routing-Key": "abc", "content-type": "application/json"},
            )
            assert r.status_code == 200, r.text
            await up.aclose()
            headers, body = worker.generate_requests[-1]
            assert body == {"input_ids": [1, 2, 3]}
            assert headers["x-smg-routing-key"] == "abc"

    run(main())


def test_bad_urls_headers_and_a_closed_client_are_refused() -> None:
    for url in ("ftp://h", "http://", "127.0.0.1:80"):
        with pytest.raises(ConfigError, match="upstream URL"):
            PooledUpstream(url, timeout_s=1, max_connections=1)
    with pytest.raises(ConfigError, match="max_connections"):
        PooledUpstream("http://127.0.0.1:1", timeout_s=1, max_connections=0)

    async def main() -> None:
        up = client("http://127.0.0.1:1")
        with pytest.raises(ValueError, match="x-evil"):
            await up.request("GET", "/", content=b"", headers={"x-evil": "a\r\nInjected: 1"})
        await up.aclose()
        with pytest.raises(UpstreamTransportError, match="closed"):
            await up.request("GET", "/", content=b"", headers={})

    run(main())
