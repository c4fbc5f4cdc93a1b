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
``/release_memory_occupation``, ``/resume_memory_occupation``. The adapter, weight and memory
routes live in ``_routes_weights``, the error mapping in ``_http``. ``/generate`` and chat take
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
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from posttrain.interface import (
    ChatCompletionRequest,
    GenerateRequest,
    SamplingParams,
    WireFormatError,
)
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import RequestTooLargeError, UnavailableError
from posttrain.local_engine._http import (
    Handler,
    body_bytes,
    decode_json,
    guard,
    http_exception_response,
    json_body,
    off_loop_if_large,
)
from posttrain.local_engine._media import MediaPool
from posttrain.local_engine._requests import (
    TextCodec,
    check_text_fits,
    drop_neutral_sglang_keys,
    json_logprob,
    media_refs,
    meta_info,
    prompt_media,
    sampling_from_params,
    seed_counter,
    tasks_from_generate,
)
from posttrain.local_engine._routes_weights import weight_routes
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.models import KVCache, MediaBatch, MediaFiles

__all__ = ["ServerContext", "create_app"]

VERSION = "0.1.0"


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
    next_seed = seed_counter(cfg.random_seed)

    def no_text(tok: int) -> str | None:
        return None

    def token_text(tok: int) -> str | None:
        return _tok_str(ctx.codec, tok)

    # ---- info ------------------------------------------------------------------------

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(request: Request) -> Response:
        engine.check_available()
        task = GenTask(
            input_ids=[0],
            max_new_tokens=1,
            sampling=sampling_from_params(None, default_seed=0)[0],
            seed=0,
            return_logprob=True,
        )
        (res,) = await sched.submit([task])
        # Honest: weights that turn into NaN/Inf logprobs cannot generate, whatever the status.
        lps = [lp for lp, _ in res.output_token_logprobs or []]
        if not lps or not all(math.isfinite(lp) for lp in lps):
            raise UnavailableError(f"a one-token generation gave logprobs {lps}: not finite")
        return Response(status_code=200)

    def model_info_dict() -> dict[str, Any]:
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path if ctx.codec is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": engine.model.config.has_vision_tower,
            "has_audio_understanding": engine.model.config.has_audio_tower,
            "model_type": ctx.model_type,
            "architectures": ctx.architectures,
        }

    async def model_info(request: Request) -> Response:
        return JSONResponse(model_info_dict())

    async def server_info(request: Request) -> Response:
        info: dict[str, Any] = {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path if ctx.codec is not None else None,
            "served_model_name": cfg.model_name,
            "host": cfg.host,
            "port": cfg.port,
            "random_seed": cfg.random_seed,
            "enable_lora": cfg.enable_lora,
            "max_loras_per_batch": cfg.max_loras_per_batch,
            "max_loaded_loras": cfg.adapter_limit,
            "lora_paths": cfg.lora_paths,
            "max_running_requests": max_running,
            "max_queued_requests": cfg.max_queued_requests,
            "context_length": engine.max_context,
            "tp_size": 1,
            "dp_size": 1,
            "device": "cpu",
            "numerics": cfg.numerics,
            "quantization": "modelopt_fp4" if ctx.quantization else None,
            "quantization_report": ctx.quantization,
            "weight_version": engine.weight_version,
            "weights_serviceable": engine.unserviceable() is None,
            "memory_released": engine.released_tags,
            "stale_tensors": len(engine.stale_tensors),
            "unavailable_reason": engine.unavailable_reason,
            "weight_update_routes": ["distributed", "disk"],
            "loaded_adapters": engine.adapters.names(),
            # What posttrain.lora.AdapterClient probes: verified pushes, and replacing an
            # adapter under its name (every load here replaces atomically).
            "lora_capabilities": ["checksums"] if cfg.enable_lora else [],
            "version": f"posttrain-local-engine {VERSION}",
            "engine": "posttrain-local-engine",
            "internal_states": [
                {
                    "weight_version": engine.weight_version,
                    "queued_requests": sched.queued,
                    "running_requests": sched.in_flight,
                    "paused": sched.paused,
                    "generated_tokens": engine.generated_tokens,
                    "forward_passes": engine.forward_passes,
                }
            ],
        }
        return JSONResponse(info)

    async def list_models(request: Request) -> Response:
        created = int(ctx.started)
        data = [
            {
                "id": cfg.model_name,
                "object": "model",
                "created": created,
                "owned_by": "posttrain",
                "root": cfg.model_path,
                "max_model_len": engine.max_context,
            }
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "posttrain",
                "root": src,
                "parent": cfg.model_name,
            }
            for name, src in engine.adapters.names().items()
        ]
        return JSONResponse({"object": "list", "data": data})

    # ---- generation --------------------------------------------------------------------

    async def run_tasks(tasks: list[GenTask]) -> list[GenResult]:
        engine.check_available()
        for i, t in enumerate(tasks):
            engine.validate(t, f"[{i}] " if len(tasks) > 1 else "")
        if len(tasks) > cfg.max_queued_requests:
            raise RequestTooLargeError(
                f"input_ids: a batch of {len(tasks)} prompts exceeds max_queued_requests "
                f"{cfg.max_queued_requests}",
                field="input_ids",
            )
        return await sched.submit(tasks)

    def output_text(res: GenResult, skip_special: bool) -> str:
        if ctx.codec is None:
            return ""
        text = ctx.codec.decode(res.output_ids, skip_special_tokens=skip_special)
        return text[: len(text) - res.trim_chars] if res.trim_chars else text

    async def generate(request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await body_bytes(request, cfg.max_request_bytes)

        req = await off_loop_if_large(
            raw, lambda: GenerateRequest.parse(drop_neutral_sglang_keys(decode_json(raw)))
        )

        def prepare() -> tuple[list[GenTask], list[dict[str, Any]]]:
            return tasks_from_generate(
                req,
                codec=ctx.codec,
                next_seed=next_seed,
                max_context=engine.max_context,
                model_config=engine.model.config,
                media_files=media.files,
                max_tasks=cfg.max_queued_requests,
            )

        if req.image_data is not None or req.audio_data is not None:
            tasks, options = await media.run(prepare, field=_media_field(req))
        else:
            tasks, options = await off_loop_if_large(raw, prepare)
        results = await run_tasks(tasks)
        dt = time.perf_counter() - t0
        items = [
            {
                "text": output_text(r, o["skip_special_tokens"]),
                "output_ids": r.output_ids,
                "meta_info": meta_info(
                    r,
                    token_text=token_text if o["return_text_in_logprobs"] else no_text,
                    e2e_latency=dt,
                ),
            }
            for r, o in zip(results, options, strict=True)
        ]
        # SGLang answers a list for a batch and for n > 1 (parallel samples of one prompt).
        return JSONResponse(items if req.is_batch or len(items) > 1 else items[0])

    def chat_request(raw: bytes) -> ChatCompletionRequest:
        req = ChatCompletionRequest.parse(decode_json(raw))
        if req.stream:
            raise WireFormatError(
                "stream: streaming is not supported by local-engine", field="stream"
            )
        return req

    def chat_prompt(req: ChatCompletionRequest) -> tuple[list[int], MediaBatch | None]:
        if req.input_ids is not None:
            ids = list(req.input_ids)
        else:
            if ctx.codec is None:
                raise WireFormatError("messages: this model has no chat template", field="messages")
            msgs = [m.model_dump(exclude_none=True) for m in req.messages]
            text = ctx.codec.chat_text(msgs, **(req.chat_template_kwargs or {}))
            check_text_fits(ctx.codec, text, engine.max_context, field="messages")
            ids = ctx.codec.encode(text)
        images = media_refs(req.image_data, 0, 1, "image_data", False)
        audio = media_refs(req.audio_data, 0, 1, "audio_data", False)
        return prompt_media(ids, images, audio, engine.model.config, files=media.files)

    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await body_bytes(request, cfg.max_request_bytes)
        req = await off_loop_if_large(raw, lambda: chat_request(raw))
        if req.image_data is not None or req.audio_data is not None:
            ids, items = await media.run(lambda: chat_prompt(req), field=_media_field(req))
        else:
            ids, items = await off_loop_if_large(raw, lambda: chat_prompt(req))
        if req.n not in (None, 1):
            raise WireFormatError(
                f"n: {req.n} choices are not supported on /v1/chat/completions; send "
                "/generate with sampling_params.n for parallel samples",
                field="n",
            )
        sp = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_new_tokens=req.max_completion_tokens
            if req.max_completion_tokens is not None
            else req.max_tokens,
            stop=req.stop,
            seed=req.seed,
            no_stop_trim=req.no_stop_trim,
        )
        scfg, seed, extra = sampling_from_params(sp, default_seed=next_seed())
        task = GenTask(
            input_ids=ids,
            max_new_tokens=extra["max_new_tokens"],
            sampling=scfg,
            seed=seed,
            stop=extra["stop"],
            no_stop_trim=extra["no_stop_trim"],
            return_logprob=bool(req.logprobs) or bool(req.return_meta_info),
            top_logprobs_num=req.top_logprobs or 0,
            lora_name=req.lora_path,
            rid=req.rid or uuid.uuid4().hex,
            media=items,
        )
        (res,) = await run_tasks([task])
        text = output_text(res, True)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": res.finish_reason.get("type"),
            "matched_stop": res.finish_reason.get("matched"),
        }
        if req.logprobs and res.output_token_logprobs is not None:
            tops = res.output_top_logprobs or [None] * len(res.output_token_logprobs)
            choice["logprobs"] = {
                "content": [
                    {
                        "token": _tok_str(ctx.codec, tok),
                        "logprob": json_logprob(lp),
                        "bytes": list(_tok_str(ctx.codec, tok).encode()),
                        "top_logprobs": [
                            {
                                "token": _tok_str(ctx.codec, t),
                                "logprob": json_logprob(v),
                                "bytes": list(_tok_str(ctx.codec, t).encode()),
                            }
                            for v, t in (top or [])
                        ],
                    }
                    for (lp, tok), top in zip(res.output_token_logprobs, tops, strict=True)
                ]
            }
        if req.return_meta_info:
            choice["meta_info"] = meta_info(
                res, token_text=no_text, e2e_latency=time.perf_counter() - t0
            )
        p, c = res.prompt_tokens, len(res.output_ids)
        return JSONResponse(
            {
                "id": res.rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": req.model,
                "choices": [choice],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
            }
        )

    # ---- control -----------------------------------------------------------------------

    async def flush_cache(request: Request) -> Response:
        return PlainTextResponse("Cache flushed.\n")

    async def pause(request: Request) -> Response:
        body = await json_body(request, cfg.max_request_bytes)
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise WireFormatError(f"mode: {mode!r} is not abort, retract or in_place", field="mode")
        if mode == "abort":
            engine.abort_running.set()
        n = sched.pause(abort_queued=mode == "abort")
        return JSONResponse({"success": True, "message": f"paused ({mode}); {n} queued aborted"})

    async def resume(request: Request) -> Response:
        engine.abort_running.clear()
        sched.resume()
        return JSONResponse({"success": True, "message": "generation continued"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sched.start()
        try:
            yield
        finally:
            await sched.stop()
            media.shutdown()

    def g(handler: Handler, *, state_changing: bool = False) -> Handler:
        return guard(handler, api_key=cfg.api_key, state_changing=state_changing)

    routes = [
        Route("/health", g(health), methods=["GET"]),
        Route("/health_generate", g(health_generate), methods=["GET"]),
        Route("/model_info", g(model_info), methods=["GET"]),
        Route("/get_model_info", g(model_info), methods=["GET"]),
        Route("/server_info", g(server_info), methods=["GET"]),
        Route("/get_server_info", g(server_info), methods=["GET"]),
        Route("/v1/models", g(list_models), methods=["GET"]),
        Route("/generate", g(generate), methods=["POST"]),
        Route("/v1/chat/completions", g(chat), methods=["POST"]),
        Route("/flush_cache", g(flush_cache, state_changing=True), methods=["GET", "POST"]),
        Route("/pause_generation", g(pause, state_changing=True), methods=["POST"]),
        Route("/continue_generation", g(resume, state_changing=True), methods=["POST"]),
        *weight_routes(ctx, sched),
    ]
    handlers = {HTTPException: http_exception_response, Exception: http_exception_response}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


def _media_field(req: GenerateRequest | ChatCompletionRequest) -> str:
    return "image_data" if req.image_data is not None else "audio_data"


def _tok_str(codec: TextCodec | None, tok: int) -> str:
    if codec is None:
        return f"<{tok}>"
    return codec.decode([tok], skip_special_tokens=False)
