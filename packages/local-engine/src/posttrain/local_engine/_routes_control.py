"""Routes that steer the scheduler: ``/pause_generation``, ``/continue_generation``,
``/flush_cache``.

``/pause_generation`` takes SGLang's ``{"mode": "abort" | "retract" | "in_place"}`` (default
``abort``): ``abort`` stops the running batch and aborts the queued requests, the other two
hold the queue. ``/continue_generation`` resumes. ``/flush_cache`` answers SGLang's reply (this
engine keeps no prefix cache across requests). All three change state: the bearer token guards
them.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from posttrain.interface import WireFormatError
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._http import guard, json_body
from posttrain.local_engine._scheduler import BatchScheduler

__all__ = ["ControlRoutes"]


class ControlRoutes:
    """The pause, continue and flush routes of one engine (``routes()`` mounts them)."""

    def __init__(self, ctx: ServerContext, sched: BatchScheduler[GenTask, GenResult]) -> None:
        self.ctx, self.sched = ctx, sched

    async def flush_cache(self, request: Request) -> Response:
        return PlainTextResponse("Cache flushed.\n")

    async def pause(self, request: Request) -> Response:
        body = await json_body(request, self.ctx.config.max_request_bytes)
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise WireFormatError(f"mode: {mode!r} is not abort, retract or in_place", field="mode")
        if mode == "abort":
            self.ctx.engine.abort_running.set()
        n = self.sched.pause(abort_queued=mode == "abort")
        return JSONResponse({"success": True, "message": f"paused ({mode}); {n} queued aborted"})

    async def resume(self, request: Request) -> Response:
        self.ctx.engine.abort_running.clear()
        self.sched.resume()
        return JSONResponse({"success": True, "message": "generation continued"})

    def routes(self) -> list[Route]:
        key = self.ctx.config.api_key
        return [
            Route(
                "/flush_cache",
                guard(self.flush_cache, api_key=key, state_changing=True),
                methods=["GET", "POST"],
            ),
            Route(
                "/pause_generation",
                guard(self.pause, api_key=key, state_changing=True),
                methods=["POST"],
            ),
            Route(
                "/continue_generation",
                guard(self.resume, api_key=key, state_changing=True),
                methods=["POST"],
            ),
        ]
