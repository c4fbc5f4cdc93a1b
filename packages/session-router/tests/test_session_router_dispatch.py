"""The ASGI dispatcher: route shapes, 404/405 as JSON, path parameters and the lifespan."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from posttrain.session_router.dispatch import App, Routes


def _echo(name: str):  # type: ignore[no-untyped-def]
    async def handler(request: Request) -> Response:
        return JSONResponse({"route": name, "params": dict(request.path_params)})

    return handler


def _app(events: list[str]) -> App:
    routes = Routes()
    routes.add("/health", {"GET": _echo("health")})
    routes.add("/sessions", {"POST": _echo("create")})
    routes.add("/sessions/{session_id}", {"GET": _echo("get"), "DELETE": _echo("delete")})
    routes.add("/sessions/{session_id}/v1/chat/completions", {"POST": _echo("chat")})
    routes.add(
        "/sessions/{session_id}/{path:path}", {"GET": _echo("proxy"), "POST": _echo("proxy")}
    )

    async def up() -> None:
        events.append("startup")

    async def down() -> None:
        events.append("shutdown")

    return App(routes, state=SimpleNamespace(), on_startup=up, on_shutdown=down)


def test_routes_methods_and_parameters() -> None:
    async def main() -> list[tuple[int, Any, str | None]]:
        app = _app([])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://sr"
        ) as c:
            calls = [
                c.get("/health"),
                c.post("/sessions"),
                c.get("/sessions/abc"),
                c.delete("/sessions/abc"),
                c.post("/sessions/abc/v1/chat/completions"),
                c.post("/sessions/abc/generate"),
                c.get("/sessions/abc/v1/models"),
                c.get("/nope"),
                c.get("/sessions/"),
                c.post("/health"),
                c.put("/sessions/abc"),
                c.get("/sessions/abc/v1/chat/completions"),
            ]
            out = []
            for call in calls:
                r = await call
                out.append((r.status_code, r.json(), r.headers.get("allow")))
            return out

    got = asyncio.run(main())
    assert got[:7] == [
        (200, {"route": "health", "params": {}}, None),
        (200, {"route": "create", "params": {}}, None),
        (200, {"route": "get", "params": {"session_id": "abc"}}, None),
        (200, {"route": "delete", "params": {"session_id": "abc"}}, None),
        (200, {"route": "chat", "params": {"session_id": "abc"}}, None),
        (200, {"route": "proxy", "params": {"session_id": "abc", "path": "generate"}}, None),
        (200, {"route": "proxy", "params": {"session_id": "abc", "path": "v1/models"}}, None),
    ]
    assert got[7] == (404, {"error": "no route /nope"}, None)
    assert got[8] == (404, {"error": "no route /sessions/"}, None)
    assert got[9] == (405, {"error": "POST is not allowed here"}, "GET")
    assert got[10] == (405, {"error": "PUT is not allowed here"}, "DELETE, GET")
    assert got[11] == (405, {"error": "GET is not allowed here"}, "POST")


def test_lifespan_runs_startup_and_shutdown_once_each() -> None:
    events: list[str] = []
    app = _app(events)
    sent: list[str] = []

    async def main() -> None:
        inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

        async def receive() -> dict[str, Any]:
            return inbox.pop(0)

        async def send(message: Any) -> None:
            sent.append(message["type"])

        await app({"type": "lifespan"}, receive, send)

    asyncio.run(main())
    assert events == ["startup", "shutdown"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_a_failing_startup_is_reported_to_the_server() -> None:
    async def broken() -> None:
        raise RuntimeError("no tokenizer")

    app = App(Routes(), state=SimpleNamespace(), on_startup=broken)
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "lifespan.startup"}

        async def send(message: Any) -> None:
            sent.append(message)

        await app({"type": "lifespan"}, receive, send)

    asyncio.run(main())
    assert sent == [{"type": "lifespan.startup.failed", "message": "RuntimeError('no tokenizer')"}]
