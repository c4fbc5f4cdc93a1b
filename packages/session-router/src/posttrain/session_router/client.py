"""A small synchronous client for the session server (what a rollout driver uses per sample).

``create()`` opens a session, ``base_url(id)`` is what an OpenAI SDK agent is pointed at,
``collect(id)`` fetches the assembled sample (decoded from the safetensors wire format, optionally
overlaid on the driver's own sample) and ``close(id)`` deletes the session.
"""

from __future__ import annotations

from typing import Any

import httpx

from posttrain.interface import Sample, TransportError
from posttrain.session_router._errors import SampleAssemblyError, SessionNotFoundError
from posttrain.session_router.wire import DecodedSamples, decode_samples


class SessionClient:
    """Talks to one session server; the httpx transport is injectable, the timeout finite."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport
        )

    def _check(self, reply: httpx.Response, session_id: str | None = None) -> httpx.Response:
        if reply.status_code == 404 and session_id is not None:
            raise SessionNotFoundError(session_id)
        if reply.status_code == 422:
            raise SampleAssemblyError(reply.text)
        if reply.status_code >= 400:
            raise TransportError(
                f"{reply.request.method} {reply.request.url.path} answered {reply.status_code}: "
                f"{reply.text[:300]}",
                url=str(reply.request.url),
            )
        return reply

    def create(self) -> str:
        """Open a session; returns its id."""
        return str(self._check(self._client.post("/sessions")).json()["session_id"])

    def base_url(self, session_id: str) -> str:
        """The OpenAI ``base_url`` of a session (``.../sessions/{id}/v1``)."""
        return f"{self.url}/sessions/{session_id}/v1"

    def get(self, session_id: str) -> dict[str, Any]:
        """The session's records and metadata."""
        reply = self._check(self._client.get(f"/sessions/{session_id}"), session_id)
        data: dict[str, Any] = reply.json()
        return data

    def collect(
        self,
        session_id: str,
        *,
        max_seq_len: int | None = None,
        metadata: dict[str, Any] | None = None,
        base: Sample | None = None,
    ) -> DecodedSamples:
        """The session's assembled samples (0 or 1), overlaid onto ``base`` when given."""
        reply = self._check(
            self._client.post(
                f"/sessions/{session_id}/samples",
                json={"max_seq_len": max_seq_len, "metadata": metadata or {}},
            ),
            session_id,
        )
        return decode_samples(reply.content, base=base)

    def close(self, session_id: str) -> None:
        """Delete the session (``SessionNotFoundError`` if it is already gone)."""
        self._check(self._client.delete(f"/sessions/{session_id}"), session_id)

    def shutdown(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()
