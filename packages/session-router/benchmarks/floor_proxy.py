"""The floor of a Python HTTP hop: uvicorn (httptools) forwarding bodies over one raw connection.

A reference for ``bench_session_router.py --floor``: no routing, no JSON, no headers beyond the
fixed ones, one keep-alive upstream connection per concurrent request, replies passed back as
bytes. Whatever the session server adds on top of this is its own cost; what this adds over the
router's hop is the cost of any Python server and client on this machine.

    python floor_proxy.py PORT UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httptools
import uvicorn


class _Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.done: asyncio.Future[bytes] | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        done, self.done = self.done, None
        body, self.body = b"".join(self.body), []
        if done is not None:
            done.set_result(body)


def make_app(upstream_port: int) -> Any:
    idle: list[_Upstream] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        loop = asyncio.get_running_loop()
        if idle:
            conn = idle.pop()
        else:
            _, conn = await loop.create_connection(_Upstream, "127.0.0.1", upstream_port)
        conn.done = loop.create_future()
        conn.transport.write(
            b"POST %s HTTP/1.1\r\nHost: upstream\r\nContent-Type: application/json\r\n"
            b"X-SMG-Routing-Key: floor\r\nContent-Length: %d\r\n\r\n%s"
            % (scope["path"].encode(), len(body), body)
        )
        reply = await conn.done
        idle.append(conn)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(reply)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": reply})

    return app


if __name__ == "__main__":
    uvicorn.run(
        make_app(int(sys.argv[2])),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        http="httptools",
        proxy_headers=False,
        log_level="warning",
        access_log=False,
    )
