"""The HTTP front: SGLang's routes and JSON shapes over Starlette.

Routes (SGLang names): ``GET /health``, ``/health_generate``, ``/model_info``,
``/get_model_info``, ``/server_info``, ``/get_server_info``, ``/v1/models``;
``POST /generate``, ``/v1/chat/completions``, ``/load_lora_adapter``,
``/unload_lora_adapter``, ``/load_lora_adapter_from_tensors``,
``/update_weights_from_disk``, ``/flush_cache``, ``/pause_generation``,
``/continue_generation``; the wsync/1 session ``/begin_weight_update``,
``/update_weights_from_safetensors``, ``/update_weights_from_shm``,
``/end_weight_update``, ``/abort_weight_update``; ``GET /weights_checksum``.

Errors are JSON ``{"error": {"message", "type", "field", "code"}}``: 400 for a
malformed body or field (named), 401 for a missing bearer token on a
state-changing route, 409 for a stale weight version, 413 for an oversize
request, 503 when the queue is full or the weights are invalid after a failed
update. Departure from SGLang: ``--api-key`` guards only routes that change
state (weights, adapters, pause), so an sgl-router in front needs no key to
generate or probe health.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from posttrain.interface import (
    BucketManifest,
    ChatCompletionRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    PosttrainError,
    SamplingParams,
    StaleVersionError,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    WeightSyncError,
    WeightUpdateBegin,
    WireFormatError,
)
from posttrain.local_engine._buckets import dtype_from_name, unpack_bucket
from posttrain.local_engine._config import EngineConfig
from posttrain.local_engine._engine import Engine, GenResult, GenTask
from posttrain.local_engine._errors import (
    AdapterError,
    CheckpointError,
    OverloadedError,
    RequestTooLargeError,
    UnauthorizedError,
    UnavailableError,
    UnknownAdapterError,
    UpdateSessionError,
)
from posttrain.local_engine._lora import load_peft_adapter
from posttrain.local_engine._requests import (
    TextCodec,
    drop_neutral_sglang_keys,
    meta_info,
    sampling_from_params,
    seed_counter,
    tasks_from_generate,
)
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.local_engine._transports import (
    ShmMaps,
    read_safetensors_bucket,
    safetensors_metadata,
)

__all__ = ["ServerContext", "create_app"]

VERSION = "0.1.0"


@dataclass(slots=True, kw_only=True)
class ServerContext:
    """What the routes share: config, engine, tokenizer, checkpoint facts."""

    config: EngineConfig
    engine: Engine
    codec: TextCodec | None = None
    model_type: str = "qwen3_moe"
    architectures: list[str] = field(default_factory=lambda: ["Qwen3MoeForCausalLM"])
    quantization: dict[str, Any] | None = None
    load_checkpoint: Callable[[str], dict[str, torch.Tensor]] | None = None
    started: float = field(default_factory=time.time)


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
        WireFormatError
        | WeightSyncError
        | AdapterError
        | UnknownAdapterError
        | CheckpointError
        | UpdateSessionError,
    ):
        return 400
    return 500


def _error(e: Exception) -> JSONResponse:
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


Handler = Callable[[Request], Awaitable[Response]]


def create_app(ctx: ServerContext) -> Starlette:
    """The ASGI app; its lifespan starts and stops the batch scheduler."""
    cfg, engine = ctx.config, ctx.engine
    sched: BatchScheduler[GenTask, GenResult] = BatchScheduler(
        engine.run_batch,
        batch_key=lambda t: t.lora_name,
        abort_result=engine.abort_result,
        max_queue=cfg.max_queued_requests,
        max_batch=cfg.max_running_requests,
    )
    shm = ShmMaps(cfg.shm_dir)
    next_seed = seed_counter(cfg.random_seed)

    def token_text(tok: int) -> str | None:
        return None

    def guard(handler: Handler, *, state_changing: bool = False) -> Handler:
        async def wrapped(request: Request) -> Response:
            try:
                if state_changing and cfg.api_key is not None:
                    auth = request.headers.get("authorization", "")
                    expected = f"Bearer {cfg.api_key}"
                    if not hmac.compare_digest(auth.encode(), expected.encode()):
                        raise UnauthorizedError(
                            f"{request.url.path}: missing or wrong bearer token"
                        )
                return await handler(request)
            except PosttrainError as e:
                return _error(e)

        return wrapped

    async def body_bytes(request: Request, limit: int) -> bytes:
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
                raise RequestTooLargeError(
                    f"body: exceeds the limit of {limit} bytes", field="body"
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def json_body(request: Request) -> Any:
        raw = await body_bytes(request, cfg.max_request_bytes)
        try:
            return json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WireFormatError(f"body: malformed JSON ({e})", field="body") from None

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
        )
        await sched.submit([task])
        return Response(status_code=200)

    def model_info_dict() -> dict[str, Any]:
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path if ctx.codec is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
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
            "max_running_requests": cfg.max_running_requests,
            "max_queued_requests": cfg.max_queued_requests,
            "context_length": engine.max_context,
            "tp_size": 1,
            "dp_size": 1,
            "device": "cpu",
            "numerics": cfg.numerics,
            "quantization": "modelopt_fp4" if ctx.quantization else None,
            "quantization_report": ctx.quantization,
            "weight_version": engine.weight_version,
            "weights_serviceable": engine.unavailable_reason is None,
            "unavailable_reason": engine.unavailable_reason,
            "weight_update_protocol": "wsync/1",
            "weight_update_transports": ["disk", "http_safetensors", "shm"],
            "loaded_adapters": engine.adapters.names(),
            "version": f"posttrain-local-engine {VERSION}",
            "engine": "posttrain-local-engine",
            "internal_states": [
                {
                    "weight_version": engine.weight_version,
                    "queued_requests": sched.queued,
                    "running_requests": sched.in_flight,
                    "paused": sched.paused,
                    "generated_tokens": engine.generated_tokens,
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
        req = GenerateRequest.parse(drop_neutral_sglang_keys(await json_body(request)))
        tasks, options = tasks_from_generate(req, codec=ctx.codec, next_seed=next_seed)
        results = await run_tasks(tasks)
        dt = time.perf_counter() - t0
        items = [
            {
                "text": output_text(r, o["skip_special_tokens"]),
                "output_ids": r.output_ids,
                "meta_info": meta_info(r, token_text=token_text, e2e_latency=dt),
            }
            for r, o in zip(results, options, strict=True)
        ]
        return JSONResponse(items if req.is_batch else items[0])

    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        req = ChatCompletionRequest.parse(await json_body(request))
        if req.stream:
            raise WireFormatError(
                "stream: streaming is not supported by local-engine", field="stream"
            )
        if req.input_ids is not None:
            ids = list(req.input_ids)
        else:
            if ctx.codec is None:
                raise WireFormatError("messages: this model has no chat template", field="messages")
            msgs = [m.model_dump(exclude_none=True) for m in req.messages]
            ids = ctx.codec.chat_ids(msgs, **(req.chat_template_kwargs or {}))
        sp = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_new_tokens=req.max_completion_tokens
            if req.max_completion_tokens is not None
            else req.max_tokens,
            stop=req.stop,
            seed=req.seed,
            n=req.n,
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
                        "logprob": lp,
                        "bytes": list(_tok_str(ctx.codec, tok).encode()),
                        "top_logprobs": [
                            {
                                "token": _tok_str(ctx.codec, t),
                                "logprob": v,
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
                res, token_text=token_text, e2e_latency=time.perf_counter() - t0
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

    # ---- adapters ----------------------------------------------------------------------

    def lora_reply(ok: bool, message: str = "") -> JSONResponse:
        return JSONResponse(
            {"success": ok, "error_message": message, "loaded_adapters": engine.adapters.names()},
            status_code=200 if ok else 400,
        )

    def require_lora() -> None:
        if not cfg.enable_lora:
            raise AdapterError("LoRA is disabled: start the engine with --enable-lora")

    async def load_lora(request: Request) -> Response:
        require_lora()
        req = LoadLoraAdapterRequest.parse(await json_body(request))
        adapter = load_peft_adapter(req.lora_name, req.lora_path, engine.lora_targets)
        engine.adapters.put(adapter)
        return lora_reply(True)

    async def unload_lora(request: Request) -> Response:
        require_lora()
        req = UnloadLoraAdapterRequest.parse(await json_body(request))
        engine.adapters.remove(req.lora_name)
        return lora_reply(True)

    async def load_lora_from_tensors(request: Request) -> Response:
        require_lora()
        raw = await body_bytes(request, cfg.max_update_bytes)
        meta = safetensors_metadata(raw)
        name = meta.get("lora_name")
        if not name:
            raise WireFormatError("__metadata__.lora_name: missing", field="__metadata__.lora_name")
        try:
            config = json.loads(meta.get("config_dict", ""))
        except json.JSONDecodeError:
            raise WireFormatError(
                "__metadata__.config_dict: missing or not JSON (the PEFT adapter config)",
                field="__metadata__.config_dict",
            ) from None
        engine.load_adapter_tensors(name, config, st_load(raw))
        return lora_reply(True)

    # ---- weights -----------------------------------------------------------------------

    async def begin_update(request: Request) -> Response:
        req = WeightUpdateBegin.parse(await json_body(request))
        engine.begin_update(
            update_id=req.update_id,
            weight_version=req.weight_version,
            kind=req.kind,
            expected=[(e.name, dtype_from_name(e.dtype), tuple(e.shape)) for e in req.expected],
            lora_name=req.lora_name,
            lora_config=req.lora_config,
        )
        return JSONResponse({"success": True, "message": f"update {req.update_id!r} open"})

    async def bucket_reply(manifest: BucketManifest) -> Response:
        return JSONResponse(
            {
                "success": True,
                "message": f"bucket {manifest.bucket_index} staged",
                "bucket_index": manifest.bucket_index,
            }
        )

    async def update_from_safetensors(request: Request) -> Response:
        raw = await body_bytes(request, cfg.max_update_bytes)
        manifest, tensors = read_safetensors_bucket(raw)
        engine.add_bucket(manifest, tensors)
        return await bucket_reply(manifest)

    async def update_from_shm(request: Request) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise WireFormatError("body: expected a JSON object", field="body")
        manifest = BucketManifest.parse(body.get("manifest"))
        try:
            view = shm.slot(
                str(body.get("shm_path", "")),
                int(body.get("slot", -1)),
                None if body.get("slot_bytes") is None else int(body["slot_bytes"]),
            )
            tensors = unpack_bucket(manifest, view)
        except WireFormatError as e:
            engine.fail_update(manifest.update_id, str(e))
            raise
        engine.add_bucket(manifest, tensors)
        return await bucket_reply(manifest)

    async def end_update(request: Request) -> Response:
        body = await json_body(request)
        update_id = str(body.get("update_id", "")) if isinstance(body, dict) else ""
        result, session = engine.finish_update(update_id)
        shm.release()
        if result.success:
            await sched.call_exclusive(lambda: engine.commit(session))
        return JSONResponse(
            result.to_dict() | {"success": result.success, "message": result.message},
            status_code=200 if result.success else 400,
        )

    async def abort_update(request: Request) -> Response:
        body = await json_body(request)
        uid = body.get("update_id") if isinstance(body, dict) else None
        aborted = engine.abort_update(None if uid is None else str(uid))
        shm.release()
        return JSONResponse(
            {
                "success": True,
                "aborted": aborted,
                "message": "update aborted; generation answers 503 until a full update"
                if aborted
                else "no matching update open",
            }
        )

    async def update_from_disk(request: Request) -> Response:
        req = UpdateWeightsFromDiskRequest.parse(await json_body(request))
        if ctx.load_checkpoint is None:
            raise CheckpointError("this engine cannot reload checkpoints")
        version: int | None = None
        if req.weight_version is not None:
            try:
                version = int(req.weight_version)
            except ValueError:
                raise WireFormatError(
                    f"weight_version: {req.weight_version!r} is not an integer",
                    field="weight_version",
                ) from None
        loader = ctx.load_checkpoint
        try:
            tensors = await sched.call_exclusive(lambda: loader(req.model_path))
            await sched.call_exclusive(lambda: engine.load_full_state(tensors, version))
        except StaleVersionError:
            raise
        except PosttrainError as e:
            engine.mark_failed(f"update_weights_from_disk {req.model_path!r}: {e}")
            raise
        return JSONResponse(
            {
                "success": True,
                "message": f"loaded {req.model_path}",
                "num_paused_requests": 0,
                "weight_version": engine.weight_version,
            }
        )

    async def weights_checksum(request: Request) -> Response:
        sha = await sched.call_exclusive(engine.weights_sha256)
        return JSONResponse({"sha256": sha, "weight_version": engine.weight_version})

    # ---- control -----------------------------------------------------------------------

    async def flush_cache(request: Request) -> Response:
        return PlainTextResponse("Cache flushed.\n")

    async def pause(request: Request) -> Response:
        body = await json_body(request)
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

    g = guard
    routes = [
        Route("/health", g(health), methods=["GET"]),
        Route("/health_generate", g(health_generate), methods=["GET"]),
        Route("/model_info", g(model_info), methods=["GET"]),
        Route("/get_model_info", g(model_info), methods=["GET"]),
        Route("/server_info", g(server_info), methods=["GET"]),
        Route("/get_server_info", g(server_info), methods=["GET"]),
        Route("/v1/models", g(list_models), methods=["GET"]),
        Route("/weights_checksum", g(weights_checksum), methods=["GET"]),
        Route("/generate", g(generate), methods=["POST"]),
        Route("/v1/chat/completions", g(chat), methods=["POST"]),
        Route("/load_lora_adapter", g(load_lora, state_changing=True), methods=["POST"]),
        Route("/unload_lora_adapter", g(unload_lora, state_changing=True), methods=["POST"]),
        Route(
            "/load_lora_adapter_from_tensors",
            g(load_lora_from_tensors, state_changing=True),
            methods=["POST"],
        ),
        Route(
            "/update_weights_from_disk", g(update_from_disk, state_changing=True), methods=["POST"]
        ),
        Route("/begin_weight_update", g(begin_update, state_changing=True), methods=["POST"]),
        Route(
            "/update_weights_from_safetensors",
            g(update_from_safetensors, state_changing=True),
            methods=["POST"],
        ),
        Route(
            "/update_weights_from_shm", g(update_from_shm, state_changing=True), methods=["POST"]
        ),
        Route("/end_weight_update", g(end_update, state_changing=True), methods=["POST"]),
        Route("/abort_weight_update", g(abort_update, state_changing=True), methods=["POST"]),
        Route("/flush_cache", g(flush_cache, state_changing=True), methods=["GET", "POST"]),
        Route("/pause_generation", g(pause, state_changing=True), methods=["POST"]),
        Route("/continue_generation", g(resume, state_changing=True), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _tok_str(codec: TextCodec | None, tok: int) -> str:
    if codec is None:
        return f"<{tok}>"
    return codec.decode([tok], skip_special_tokens=False)
