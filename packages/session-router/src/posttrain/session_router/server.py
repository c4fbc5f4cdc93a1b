"""State shared by the session server's routes: sessions, TTL reaping, the upstream client, metrics.

The upstream client is an ``Upstream`` (upstream.py): ``PooledUpstream`` by default, or an
``HttpxUpstream`` whose transport is injected (tests use ``httpx.MockTransport``); its timeout is
finite unless ``math.inf`` is configured explicitly. Expired sessions are reclaimed lazily on
access and by a reaper task; a session whose lock is held (a turn being prepared or committed) is
never reclaimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request

from posttrain.session_router._errors import SessionNotFoundError
from posttrain.session_router.allocator import loaded_allocator
from posttrain.session_router.config import SessionRouterConfig
from posttrain.session_router.template import ChatTokenizer
from posttrain.session_router.tito import SessionState
from posttrain.session_router.upstream import HttpxUpstream, PooledUpstream, Upstream


class BodyTooLargeError(Exception):
    """A request body exceeded ``max_body_bytes`` (answered with 413)."""


@dataclass(kw_only=True)
class Metrics:
    """The Prometheus collectors of one server instance (own registry, so apps do not collide)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "session_router_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.turns = Counter(
            "session_router_turns", "Chat turns by outcome", ["outcome"], registry=r
        )
        self.upstream_seconds = Histogram(
            "session_router_upstream_seconds", "Upstream /generate latency", registry=r
        )
        self.sessions = Gauge("session_router_sessions", "Live sessions", registry=r)
        self.created = Counter(
            "session_router_sessions_created",
            "Sessions created (POST /sessions, and one per sample of POST /rollouts)",
            registry=r,
        )
        self.expired = Counter(
            "session_router_sessions_expired", "Sessions reclaimed by TTL", registry=r
        )


class TokenizerCollector(Collector):
    """Exports the tokenizer's own counters: time spent tokenizing, and encode-cache hits/misses."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok

    def collect(self) -> Iterator[CounterMetricFamily]:
        cache = self.tok.encode_cache
        yield CounterMetricFamily(
            "session_router_tokenize_seconds",
            "Wall time spent tokenizing texts that were not in the encode cache",
            value=self.tok.tokenize_seconds,
        )
        yield CounterMetricFamily(
            "session_router_encode_cache_hits", "Encode-cache hits", value=cache.hits
        )
        yield CounterMetricFamily(
            "session_router_encode_cache_misses", "Encode-cache misses", value=cache.misses
        )


class SessionServer:
    """Sessions, the upstream client, the tokenizer and the metrics of one server instance."""

    def __init__(
        self,
        cfg: SessionRouterConfig,
        tok: ChatTokenizer,
        transport: httpx.AsyncBaseTransport | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        self.cfg = cfg
        self.tok = tok
        self.instance_id = uuid.uuid4().hex
        self.allocator = loaded_allocator()  # reported by /health
        self.sessions: dict[str, SessionState] = {}
        self.metrics = Metrics()
        self.metrics.registry.register(TokenizerCollector(tok))
        self.upstream: Upstream
        if upstream is not None:
            self.upstream = upstream
        elif transport is not None:
            self.upstream = HttpxUpstream(
                cfg.upstream_url,
                timeout_s=cfg.upstream_timeout_s,
                max_connections=cfg.max_connections,
                transport=transport,
            )
        else:
            self.upstream = PooledUpstream(
                cfg.upstream_url,
                timeout_s=cfg.upstream_timeout_s,
                max_connections=cfg.max_connections,
            )
        self._reaper: asyncio.Task[None] | None = None

    def create(self, *, weight_version: int | None = None) -> SessionState:
        """A new empty session whose LoRA requests name adapter version ``weight_version``."""
        state = SessionState(session_id=uuid.uuid4().hex, weight_version=weight_version)
        self.sessions[state.session_id] = state
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.created.inc()
        return state

    def get(self, session_id: str) -> SessionState:
        """The live session with this id; an expired one is reclaimed here (``SessionNotFoundError``)."""
        state = self.sessions.get(session_id)
        if state is None or state.closing:
            raise SessionNotFoundError(session_id)
        if time.monotonic() - state.last_used > self.cfg.session_ttl_s and not state.lock.locked():
            self.drop(session_id, expired=True)
            raise SessionNotFoundError(session_id)
        state.last_used = time.monotonic()
        return state

    def drop(self, session_id: str, *, expired: bool = False) -> None:
        """Forget a session and mark it closing (an in-flight turn then does not commit)."""
        state = self.sessions.pop(session_id, None)
        if state is not None:
            state.closing = True
            if expired:
                self.metrics.expired.inc()
        self.metrics.sessions.set(len(self.sessions))

    def reap_expired(self) -> int:
        """Reclaim every session idle for longer than the TTL; returns how many."""
        now = time.monotonic()
        stale = [
            sid
            for sid, s in self.sessions.items()
            if now - s.last_used > self.cfg.session_ttl_s and not s.lock.locked()
        ]
        for sid in stale:
            self.drop(sid, expired=True)
        return len(stale)

    def start_reaper(self) -> None:
        """Start the background TTL reaper on the running loop (idempotent)."""
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        interval = max(0.05, min(self.cfg.session_ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(interval)
            self.reap_expired()

    async def aclose(self) -> None:
        """Stop the reaper and close the upstream connections."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.upstream.aclose()

    async def read_body(self, request: Request) -> bytes:
        """The request body, refusing more than ``max_body_bytes`` (``BodyTooLargeError``)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            raise BodyTooLargeError
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.cfg.max_body_bytes:
                raise BodyTooLargeError
            chunks.append(chunk)
        return b"".join(chunks)
