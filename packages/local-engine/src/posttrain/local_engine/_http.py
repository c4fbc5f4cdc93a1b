"""HTTP plumbing shared by the routes: error JSON and status codes, body limits, the token guard.

No reply is ever a plain-text error: posttrain errors map to their status (``_status``), an
unknown route or method to ``NotFound``/``MethodNotAllowed``, and any other exception (a bug,
not bad input) to a JSON 500 of type ``InternalServerError`` whose traceback goes to the log.
Bodies are read against a byte limit before anything parses them, and a large body is
decoded in a thread so the event loop keeps answering ``/health``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from posttrain.interface import PosttrainError, StaleVersionError, WeightSyncError, WireFormatError
from posttrain.local_engine._errors import (
    AdapterError,
    CheckpointError,
    NonFiniteWeightsError,
    OverloadedError,
    RequestTooLargeError,
    UnauthorizedError,
    UnavailableError,
)

__all__ = [
    "INLINE_BODY_BYTES",
    "Handler",
    "body_bytes",
    "decode_json",
    "error_response",
    "guard",
    "http_exception_response",
    "internal_error_response",
    "json_body",
    "off_loop_if_large",
]

Handler = Callable[[Request], Awaitable[Response]]
X = TypeVar("X")
# A body up to this size is decoded (and tokenized) on the event loop: a thread hop costs
# more than the work. Anything larger goes to a thread.
INLINE_BODY_BYTES = 16 * 1024
_log = logging.getLogger("posttrain.local_engine")
_HTTP_TYPES = {404: "NotFound", 405: "MethodNotAllowed"}


def _status(e: Exception) -> int:
    if isinstance(e, UnauthorizedError):
        return 401
    if isinstance(e, RequestTooLargeError):
        return 413
    if isinstance(e, OverloadedError | UnavailableError):
        return 503
    if isinstance(e, StaleVersionError):
        return 409
    if isinstance(
        e,
        WireFormatError | WeightSyncError | AdapterError | CheckpointError | NonFiniteWeightsError,
    ):
        return 400
    return 500


def _reply(
    code: int, message: str, kind: str, field: str | None = None, headers: Any = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "field": field, "code": code}}
    return JSONResponse(body, status_code=code, headers=headers)


def error_response(e: Exception) -> JSONResponse:
    """``{"error": {"message", "type", "field", "code"}}`` with the status the error maps to."""
    return _reply(_status(e), str(e), type(e).__name__, getattr(e, "field", None))


def internal_error_response(e: BaseException, where: str = "") -> JSONResponse:
    """A JSON 500 for an exception that is not bad input; the traceback goes to the log."""
    _log.error("unexpected error%s", f" on {where}" if where else "", exc_info=e)
    return _reply(500, f"internal error: {type(e).__name__}: {e}", "InternalServerError")


async def http_exception_response(request: Request, e: Exception) -> Response:
    """Starlette's own 404/405 (no such route, wrong method) as the same error JSON."""
    if not isinstance(e, HTTPException):
        return internal_error_response(e, request.url.path)
    kind = _HTTP_TYPES.get(e.status_code, "HTTPError")
    return _reply(e.status_code, f"{request.url.path}: {e.detail}", kind, headers=e.headers)


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
        except Exception as e:  # a bug, not bad input: still JSON, never a plain-text 500
            return internal_error_response(e, f"{request.method} {request.url.path}")

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


def decode_json(raw: bytes) -> Any:
    """The decoded JSON body (``{}`` when empty); malformed JSON is a 400 naming ``body``."""
    try:
        return json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise WireFormatError(
            f"body: malformed JSON ({type(e).__name__}: {e})", field="body"
        ) from None


async def off_loop_if_large(raw: bytes, work: Callable[[], X]) -> X:
    """Run ``work`` (decoding, tokenizing ``raw``) inline for a small body, in a thread otherwise.

    By the body's size only, never by a key found in the raw bytes (JSON can escape any key).
    Media work never comes here: the routes send a parsed request that names media to the
    media pool (``_media.MediaPool``)."""
    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(work)
    return work()


async def json_body(request: Request, limit: int) -> Any:
    """The decoded JSON body, length-checked first; a large one is decoded in a thread."""
    raw = await body_bytes(request, limit)
    return await off_loop_if_large(raw, lambda: decode_json(raw))
