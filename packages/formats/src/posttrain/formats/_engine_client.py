"""One HTTP client per engine for SGLang's weight routes (the transport is a seam).

``EngineClient.post(route, body)`` sends a request body (a ``WireModel`` of ``_sglang_requests``
or a plain dict) and returns the decoded reply. Any failure raises the interface's
``EngineError`` whose message names the engine, the route and SGLang's own message
(``message`` / ``error_message`` / FastAPI's ``detail``); a reply of ``success: false`` is a
failure even with status 200. A 409 raises ``StaleVersionError``. Connection failures and
timeouts keep httpx's error as ``__cause__`` (callers tell an unreachable engine by it).
"""

from __future__ import annotations

from typing import Any

import httpx

from posttrain.interface import EngineError, StaleVersionError, WireModel

__all__ = ["EngineClient", "reply_message"]


def reply_message(body: Any, fallback: str) -> str:
    """SGLang's message in a reply body (its keys differ by route)."""
    if isinstance(body, dict):
        for key in ("message", "error_message", "detail", "error"):
            value = body.get(key)
            if isinstance(value, dict):  # posttrain's {"error": {"message": ...}}
                return reply_message(value, str(value))
            if value:
                return value if isinstance(value, str) else str(value)
    return fallback


class EngineClient:
    """A synchronous client for one engine; ``http`` or ``transport`` replace the network."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = http or httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )
        if http is not None:
            self._http.headers.update(headers)

    @property
    def http(self) -> httpx.Client:
        """The HTTP client to this engine (base URL, bearer token and timeout set), for another
        route-level client of the same engine to borrow (lora-core's ``AdapterClient``)."""
        return self._http

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self, method: str, route: str, body: WireModel | dict[str, Any] | None = None,
        *, timeout_s: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Send and decode; raise ``EngineError`` naming engine, route and message."""
        where = f"engine {self.base_url} {method} {route}"
        payload = body.to_dict() if isinstance(body, WireModel) else body
        extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            r = self._http.request(method, route, json=payload, **extra)
        except httpx.HTTPError as exc:
            raise EngineError(
                f"{where}: {type(exc).__name__}: {exc}", url=f"{self.base_url}{route}"
            ) from exc
        try:
            data = r.json()
        except ValueError:
            data = {"message": r.text[:500]}
        if not isinstance(data, dict):
            data = {"message": str(data)[:500]}
        failed = r.status_code != 200 or data.get("success") is False
        if failed:
            message = reply_message(data, r.text[:500])
            text = f"{where}: HTTP {r.status_code}: {message}"
            if r.status_code == 409:
                raise StaleVersionError(text)
            raise EngineError(text, url=f"{self.base_url}{route}", status=r.status_code)
        return data

    def post(
        self, route: str, body: WireModel | dict[str, Any] | None = None,
        *, timeout_s: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        return self.request("POST", route, body, timeout_s=timeout_s)

    def get(self, route: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self.request("GET", route, timeout_s=timeout_s)
