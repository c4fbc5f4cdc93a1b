"""Routes that free and restore the weights' memory: SGLang's ``/release_memory_occupation``
and ``/resume_memory_occupation``.

The body is ``{"tags": ["weights", "kv_cache"]}``, or no body / no tags for all. Released
weights come back zero-filled: like SGLang, resumed weights are not valid until pushed again;
unlike SGLang, this engine knows which tensors were not re-sent, so ``/generate`` answers 503
naming them until every base tensor (the towers included) arrived through an update. Both run
on the scheduler's worker thread, between batches; both change state (the bearer token guards
them).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.interface import WireFormatError
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._http import body_bytes, decode_json, guard
from posttrain.local_engine._scheduler import BatchScheduler

__all__ = ["MemoryRoutes"]


class MemoryRoutes:
    """The memory release and resume routes of one engine (``routes()`` mounts them)."""

    def __init__(self, ctx: ServerContext, sched: BatchScheduler[GenTask, GenResult]) -> None:
        self.ctx, self.sched = ctx, sched

    async def tags(self, request: Request) -> list[str] | None:
        """The body's ``tags`` (``None``: all), every other field refused by name."""
        raw = await body_bytes(request, self.ctx.config.max_request_bytes)
        body = decode_json(raw) if raw.strip() else {}  # no body = all tags
        if body is None:
            return None
        if not isinstance(body, dict):
            raise WireFormatError("body: expected a JSON object with optional tags", field="body")
        unknown = sorted(set(body) - {"tags"})
        if unknown:
            raise WireFormatError(f"{unknown[0]}: unknown field", field=unknown[0])
        tags = body.get("tags")
        if tags is None:
            return None
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise WireFormatError("tags: expected a list of strings or null", field="tags")
        return list(tags)

    async def release(self, request: Request) -> Response:
        tags = await self.tags(request)
        engine = self.ctx.engine
        released = await self.sched.call_exclusive(lambda: engine.release_memory(tags))
        return JSONResponse(
            {"success": True, "message": f"released {released}", "released": released}
        )

    async def resume(self, request: Request) -> Response:
        tags = await self.tags(request)
        engine = self.ctx.engine
        still = await self.sched.call_exclusive(lambda: engine.resume_memory(tags))
        return JSONResponse(
            {
                "success": True,
                "message": "resumed; the weights are not valid until pushed again"
                if engine.stale_tensors
                else "resumed",
                "released": still,
                "stale_tensors": len(engine.stale_tensors),
            }
        )

    def routes(self) -> list[Route]:
        key = self.ctx.config.api_key
        return [
            Route(path, guard(handler, api_key=key, state_changing=True), methods=["POST"])
            for path, handler in (
                ("/release_memory_occupation", self.release),
                ("/resume_memory_occupation", self.resume),
            )
        ]
