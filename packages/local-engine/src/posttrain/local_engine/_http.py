"""HTTP plumbing shared by the routes: error JSON and status codes, body limits, the token guard."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from posttrain.interface import PosttrainError, StaleVersionError, WeightSyncError, WireFormatError
from posttrain.local_engine._errors import (
    AdapterError,
    CheckpointError,
    OverloadedError,
    RequestTooLargeError,
    UnauthorizedError,
    UnavailableError,
)

__all__ = ["Handler", "body_bytes", "error_response", "guard", "json_body"]

Handler = Callable[[Request], Awaitable[Response]]


def _status(e: Exception) -> int:
    if isinstance(e, UnauthorizedError):
        return 401
    if isinstance(e, RequestTooLargeError):
        return 413
    if isinstance(e, OverloadedError | UnavailableError):
        return 503
    if isinstance(e, StaleVersionError):
        return 409
    if isinstance(e, WireFormatError | WeightSyncError | AdapterError | CheckpointError):
        return 400
    return 500


def error_response(e: Exception) -> JSONResponse:
    """``{"error": {"message", "type", "field", "code"}}`` with the status the error maps to."""
    code = _status(e)
    return JSONResponse(
        {
            "error": {
                "message": str(e),
                "type": type(e).__name__,
                "field": getattr(e, "field", None),
                "code": code,
            }
        },
        status_code=code,
    )


def guard(handler: Handler, *, api_key: str | None, state_changing: bool = False) -> Handler:
    """Map posttrain errors to JSON replies; require the bearer token on state-changing routes."""

    async def wrapped(request: Request) -> Response:
        try:
            if state_changing and api_key is not None:
                auth = request.headers.get("authorization", "")
                if not hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
                    raise UnauthorizedError(f"{request.url.path}: missing or wrong bearer token")
            return await handler(request)
        except PosttrainError as e:
            return error_response(e)

    return wrapped


async def body_bytes(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes without reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(
            f"body: {declared} bytes exceed the limit of {limit}", field="body"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"body: exceeds the limit of {limit} bytes", field="body")
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request, limit: int) -> Any:
    """The decoded JSON body (``{}`` when empty); malformed JSON is a 400 naming ``body``."""
    raw = await body_bytes(request, limit)
    try:
        return json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WireFormatError(f"body: malformed JSON ({e})", field="body") from None
