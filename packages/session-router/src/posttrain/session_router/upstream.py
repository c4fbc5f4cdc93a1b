"""The session server's HTTP seam to its upstream (sgl-router or an engine): one Protocol, two clients.

``Upstream.request`` sends one buffered request and returns the whole reply as bytes; every
transport failure (refused or reset connection, timeout, malformed or oversize reply) is an
``UpstreamTransportError`` naming the URL and the underlying exception (the routes answer 502),
and no reply within the timeout is its subclass ``UpstreamTimeoutError`` (504).

* ``PooledUpstream`` is the default: keep-alive HTTP/1.1 connections to the one upstream host,
  written directly on asyncio transports and parsed by ``httptools`` (llhttp, the parser uvicorn
  uses). The session hop is on every turn's critical path; through this client it adds 0.38 ms
  on loopback where an aiohttp client added 0.77 ms and ``httpx.AsyncClient`` ~1.7 ms
  (docs/benchmarks/session-router.md). It sends no headers of its own beyond ``Host`` and
  ``Content-Length``, never asks for an encoding and returns bytes as the upstream sent them
  (chunked bodies are de-chunked).
* ``HttpxUpstream`` wraps an ``httpx.AsyncClient`` whose transport can be injected, so tests can
  put an ``httpx.MockTransport`` (faults we cannot cause otherwise) behind the real routes.

Timeouts are finite unless ``math.inf`` was configured explicitly. A reused keep-alive connection
that the upstream closed while idle (EOF before any reply byte) is retried once on a new
connection, as browsers and HTTP libraries do; any other failure is not retried here.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools
import httpx

from posttrain.interface import ConfigError
from posttrain.session_router._errors import UpstreamTimeoutError, UpstreamTransportError


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A whole upstream reply: status, headers (lower-case names, in order) and body bytes."""

    status_code: int
    headers: tuple[tuple[str, str], ...]
    content: bytes
    url: str

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class Upstream(Protocol):
    """Sends one buffered request to the upstream base URL."""

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes,
        headers: Mapping[str, str],
        query: str = "",
    ) -> UpstreamReply:
        """``path`` starts with ``/``; ``query`` is the raw query string without ``?``."""
        ...

    async def aclose(self) -> None:
        """Close pooled connections."""
        ...


def _target(base_url: str, path: str, query: str) -> str:
    return f"{base_url}{path}?{query}" if query else f"{base_url}{path}"


class _Reply:
    """The parse state of one response on a connection (filled by httptools callbacks)."""

    __slots__ = ("body", "chunked", "complete", "has_length", "headers", "size", "status")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.has_length = False
        self.chunked = False
        self.complete = False


class _StaleConnectionError(Exception):
    """A reused connection ended before any reply byte arrived (closed by the upstream while idle)."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self, max_reply_bytes: int) -> None:
        self.max_reply_bytes = max_reply_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply = _Reply()
        self.waiter: asyncio.Future[None] | None = None
        self.received = False
        self.closed = False
        self.keep_alive = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        reply = self.reply
        if reply.status and not reply.complete and not reply.has_length and not reply.chunked:
            reply.complete = True  # a body delimited by the end of the connection
            self._finish(None)
        elif not self.received:
            self._finish(_StaleConnectionError())
        else:
            self._finish(exc or ConnectionResetError("upstream closed the connection mid-reply"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "content-length":
            self.reply.has_length = True
        elif key == "transfer-encoding" and "chunked" in text.lower():
            self.reply.chunked = True
        self.reply.headers.append((key, text))

    def on_headers_complete(self) -> None:
        self.reply.status = self.parser.get_status_code()

    def on_body(self, chunk: bytes) -> None:
        self.reply.size += len(chunk)
        if self.reply.size > self.max_reply_bytes:
            self._finish(ValueError(f"upstream reply exceeds {self.max_reply_bytes} bytes"))
            return
        self.reply.body.append(chunk)

    def on_message_complete(self) -> None:
        if self.reply.status < 200:  # an interim 1xx reply: the real one follows
            self.reply = _Reply()
            return
        self.reply.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
        if exc is not None:
            self.close()

    async def exchange(self, request: bytes) -> _Reply:
        """Send one request and wait for its whole reply."""
        assert self.transport is not None
        self.reply = _Reply()
        self.received = False
        self.keep_alive = False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await self.waiter
        return self.reply

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class PooledUpstream:
    """The default upstream client: pooled keep-alive HTTP/1.1 connections to one host."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        max_connections: int,
        max_reply_bytes: int = 1 << 30,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"upstream URL must be http(s)://host[:port], got {base_url!r}")
        if max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {max_connections}")
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._prefix = parts.path.rstrip("/")
        self._host_header = f"Host: {parts.netloc}\r\n".encode("latin-1")
        self.timeout_s = timeout_s
        self._timeout = None if math.isinf(timeout_s) else timeout_s
        self._max_reply_bytes = max_reply_bytes
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._closed = False

    def _encode(
        self, method: str, path: str, query: str, headers: Mapping[str, str], content: bytes
    ) -> bytes:
        target = f"{self._prefix}{path}?{query}" if query else f"{self._prefix}{path}"
        lines = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), self._host_header]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r}: line breaks or ':' in a header are not allowed")
            if name.lower() not in ("host", "content-length", "transfer-encoding", "connection"):
                lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if content or method not in ("GET", "DELETE"):
            lines.append(b"Content-Length: %d\r\n" % len(content))
        lines.append(b"\r\n")
        lines.append(content)
        return b"".join(lines)

    async def _connection(self) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Connection(self._max_reply_bytes), self._host, self._port, ssl=self._ssl
        )
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, False

    async def _exchange(self, request: bytes) -> _Reply:
        for _ in range(2):
            conn, reused = await self._connection()
            try:
                reply = await conn.exchange(request)
            except _StaleConnectionError:
                if reused:
                    continue  # the upstream closed this idle connection: once more on a new one
                raise ConnectionResetError(
                    "upstream closed the connection before replying"
                ) from None
            except BaseException:
                conn.close()  # cancelled or failed mid-exchange: the connection state is unknown
                raise
            if conn.keep_alive and not conn.closed and not self._closed:
                self._idle.append(conn)
            else:
                conn.close()
            return reply
        raise ConnectionResetError("upstream closed two connections before replying")

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes,
        headers: Mapping[str, str],
        query: str = "",
    ) -> UpstreamReply:
        url = _target(self.base_url, path, query)
        if self._closed:
            raise UpstreamTransportError(RuntimeError("upstream client is closed"), url=url)
        request = self._encode(method, path, query, headers, content)
        try:
            async with self._slots, asyncio.timeout(self._timeout):
                reply = await self._exchange(request)
        except TimeoutError as exc:
            raise UpstreamTimeoutError(url=url, timeout_s=self.timeout_s) from exc
        except (OSError, ValueError, httptools.HttpParserError) as exc:
            raise UpstreamTransportError(exc, url=url) from exc
        return UpstreamReply(
            status_code=reply.status,
            headers=tuple(reply.headers),
            content=b"".join(reply.body),
            url=url,
        )

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


class HttpxUpstream:
    """An ``httpx.AsyncClient`` upstream; ``transport`` replaces its HTTP transport (tests)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        max_connections: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            timeout=httpx.Timeout(None if math.isinf(timeout_s) else timeout_s),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes,
        headers: Mapping[str, str],
        query: str = "",
    ) -> UpstreamReply:
        url = _target(self.base_url, path, query)
        try:
            reply = await self._client.request(
                method, path, params=query or None, content=content, headers=dict(headers)
            )
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(url=url, timeout_s=self.timeout_s) from exc
        except httpx.HTTPError as exc:
            raise UpstreamTransportError(exc, url=url) from exc
        return UpstreamReply(
            status_code=reply.status_code,
            headers=tuple((k.lower(), v) for k, v in reply.headers.items()),
            content=reply.content,
            url=url,
        )

    async def aclose(self) -> None:
        await self._client.aclose()
