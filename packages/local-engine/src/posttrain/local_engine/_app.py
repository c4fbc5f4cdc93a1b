"""The HTTP front: SGLang's routes and JSON shapes over Starlette.

Routes (SGLang names): ``GET /health``, ``/health_generate``, ``/model_info``,
``/get_model_info``, ``/server_info``, ``/get_server_info``, ``/v1/models``;
``POST /generate``, ``/v1/chat/completions``, ``/load_lora_adapter``,
``/unload_lora_adapter``, ``/load_lora_adapter_from_tensors``,
``/update_weights_from_disk``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``; SGLang's weight-update routes ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group``,
``/update_weight_version`` (``/update_weights_from_tensor`` refused by name); ``GET
/weights_checksum``;
``/release_memory_occupation``, ``/resume_memory_occupation``. Each concern has its route
module: ``_routes_info`` (health, model and server info), ``_routes_generate`` (``/generate``,
chat), ``_routes_control`` (pause, continue, flush), ``_routes_lora`` (adapters),
``_routes_weights`` (weight updates, checksum), ``_routes_memory`` (release, resume); the
error mapping and the bearer-token guard are ``_http``'s. ``create_app`` builds what they share
(the batch scheduler, the media pool, the seed counter) and mounts them. ``/generate`` and chat take
SGLang's ``image_data`` / ``audio_data`` for multimodal checkpoints (``_requests.prompt_media``).

Errors are JSON ``{"error": {"message", "type", "field", "code"}}``: 400 for a
malformed body or field (named), 401 for a missing bearer token on a
state-changing route, 404/405 for an unknown route or method, 409 for a stale
weight version, 413 for an oversize request, 500 (``InternalServerError``) for
a bug, 503 when the queue is full or the weights are invalid (released and not re-sent). Departure from SGLang: ``--api-key`` guards only routes that change
state (weights, adapters, pause), so an sgl-router in front needs no key to
generate or probe health.

The event loop only routes: a body over ``INLINE_BODY_BYTES`` is decoded,
validated and tokenized in a thread (by size alone), a request naming media is prepared in the
media pool (``_media``: ``--media-workers`` threads, ``--media-timeout-s``, file paths only
inside ``--allowed-media-dir``), generation runs on the scheduler's worker
thread, and a text that cannot fit the context is refused from its length in
characters before it is tokenized (``tasks_from_generate``), so a 10 MB prompt
gets its 400 at once and ``/health`` keeps answering meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._http import http_exception_response
from posttrain.local_engine._media import MediaPool
from posttrain.local_engine._requests import seed_counter
from posttrain.local_engine._routes_control import ControlRoutes
from posttrain.local_engine._routes_generate import GenerationRoutes
from posttrain.local_engine._routes_info import InfoRoutes
from posttrain.local_engine._routes_lora import LoraRoutes
from posttrain.local_engine._routes_memory import MemoryRoutes
from posttrain.local_engine._routes_weights import WeightRoutes
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.models import KVCache, MediaFiles

__all__ = ["ServerContext", "create_app"]


def create_app(ctx: ServerContext) -> Starlette:
    """The ASGI app; its lifespan starts and stops the batch scheduler."""
    cfg, engine = ctx.config, ctx.engine
    max_running = cfg.running_limit(KVCache.row_bytes(engine.model.config))
    sched: BatchScheduler[GenTask, GenResult] = BatchScheduler(
        engine.run_batch,
        batch_key=lambda t: t.lora_name,
        abort_result=engine.abort_result,
        max_queue=cfg.max_queued_requests,
        max_batch=max_running,
        max_keys=cfg.max_loras_per_batch,
        run_stream=lambda first, admit, finish, rows: engine.run_stream(
            first, admit, finish, rows=rows
        ),
    )
    media = MediaPool(
        MediaFiles.engine(cfg.allowed_media_dir, max_bytes=cfg.max_media_bytes,
                          timeout_s=cfg.media_timeout_s),
        workers=cfg.media_workers, timeout_s=cfg.media_timeout_s,
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sched.start()
        try:
            yield
        finally:
            await sched.stop()
            media.shutdown()

    routes = [
        *InfoRoutes(ctx, sched, max_running=max_running).routes(),
        *GenerationRoutes(ctx, sched, media, seed_counter(cfg.random_seed)).routes(),
        *ControlRoutes(ctx, sched).routes(),
        *LoraRoutes(ctx).routes(),
        *WeightRoutes(ctx, sched).routes(),
        *MemoryRoutes(ctx, sched).routes(),
    ]
    handlers = {HTTPException: http_exception_response, Exception: http_exception_response}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
