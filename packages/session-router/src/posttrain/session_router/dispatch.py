"""A minimal ASGI dispatcher for the session server's fixed route table (no middleware stack).

The session hop is on every turn's critical path. Starlette's router (a regex per route,
tried in order, behind two exception middlewares) cost ~45 us per request on loopback; these
routes are a handful of fixed shapes under ``/sessions/{id}``, so they are matched by splitting
the path once. Handlers still take starlette ``Request`` objects and return ``Response``
objects. Unknown paths answer 404 and known paths with another method 405 (with ``Allow``),
both as ``{"error": str}`` JSON; the ASGI lifespan runs ``on_startup``/``on_shutdown``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import SimpleNamespace

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]

SESSION = "/sessions"  # session routes are matched by the path after "/sessions/{id}"


class Routes:
    """The route table: top-level paths, per-session sub-paths and the per-session catch-all."""

    def __init__(self) -> None:
        self.top: dict[str, dict[str, Handler]] = {}
        self.session: dict[str | None, dict[str, Handler]] = {}
        self.session_rest: dict[str, Handler] = {}

    def add(self, path: str, methods: Mapping[str, Handler]) -> None:
        """``path`` is ``/x``, ``/sessions/{session_id}[/sub/path]`` or ``.../{path:path}``."""
        prefix = SESSION + "/{session_id}"
        if path == prefix:
            self.session.setdefault(None, {}).update(methods)
        elif path == prefix + "/{path:path}":
            self.session_rest.update(methods)
        elif path.startswith(prefix + "/"):
            self.session.setdefault(path[len(prefix) + 1 :], {}).update(methods)
        else:
            self.top.setdefault(path, {}).update(methods)

    def match(self, path: str) -> tuple[Mapping[str, Handler] | None, dict[str, str]]:
        """The handlers by method for ``path`` and its path parameters (None: no route)."""
        table = self.top.get(path)
        if table is not None:
            return table, {}
        if not path.startswith(SESSION + "/"):
            return None, {}
        session_id, _, rest = path[len(SESSION) + 1 :].partition("/")
        if not session_id:
            return None, {}
        if not rest:
            return self.session.get(None), {"session_id": session_id}
        table = self.session.get(rest)
        if table is not None:
            return table, {"session_id": session_id}
        if self.session_rest:
            return self.session_rest, {"session_id": session_id, "path": rest}
        return None, {}


def _json_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps({"error": message}),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )


class App:
    """The ASGI application; ``state`` carries what handlers reach as ``request.app.state``."""

    def __init__(
        self,
        routes: Routes,
        *,
        state: SimpleNamespace,
        on_startup: Callable[[], Awaitable[None]] | None = None,
        on_shutdown: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.routes = routes
        self.state = state
        self.on_startup = on_startup
        self.on_shutdown = on_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        table, params = self.routes.match(scope["path"])
        if table is None:
            response = _json_error(404, f"no route {scope['path']}")
        else:
            handler = table.get(scope["method"])
            if handler is None:
                allowed = ", ".join(sorted(table))
                response = _json_error(
                    405, f"{scope['method']} is not allowed here", {"allow": allowed}
                )
            else:
                scope["app"] = self
                scope["path_params"] = params
                response = await handler(Request(scope, receive))
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if self.on_startup is not None:
                        await self.on_startup()
                except Exception as exc:  # reported to the server, which then exits
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    if self.on_shutdown is not None:
                        await self.on_shutdown()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return
