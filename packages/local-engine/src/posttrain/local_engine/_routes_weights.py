"""Routes that change the served weights: LoRA adapters and wsync/1 weight updates.

Split from ``_app`` to keep each module readable; ``create_app`` mounts these. Every
route here is state-changing, so each is wrapped with the bearer-token guard.

Reading, decoding, checking (shapes, checksums, finiteness) and staging run in threads,
never on the event loop; only the swap itself runs on the scheduler's worker thread,
between batches. Every check runs before anything is swapped, so a refused update (a bad
path, an unreadable file, a wrong shape, NaN or Inf) answers 4xx and the engine keeps
serving what it served (see ``_update`` for what an abandoned wsync/1 session does).

``/release_memory_occupation`` and ``/resume_memory_occupation`` (SGLang's names, body
``{"tags": ["weights", "kv_cache"]}`` or no tags = all) free the weights' storage and bring
it back zero-filled. Like SGLang, resumed weights are not valid until pushed again; unlike
SGLang, this engine knows which tensors were not re-sent: ``/generate`` answers 503 naming
them until every base tensor (the towers included) arrived through an update.
``/weights_checksum`` adds ``tower_sha256``, the digest of the media towers' tensors.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.formats import (
    bucket_body_manifest,
    decode_adapter_payload,
    decode_bucket_body,
    dtype_from_name,
    unpack_bucket,
    verify_adapter_checksums,
)
from posttrain.interface import (
    BucketManifest,
    LoadLoraAdapterRequest,
    ShmBucketRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    WeightUpdateBegin,
    WireFormatError,
)
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import AdapterError, CheckpointError
from posttrain.local_engine._http import Handler, body_bytes, decode_json, guard, json_body
from posttrain.local_engine._lora import load_peft_adapter
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.local_engine._transports import ShmMaps

__all__ = ["weight_routes"]


def weight_routes(
    ctx: ServerContext, sched: BatchScheduler[GenTask, GenResult], shm: ShmMaps
) -> list[Route]:
    """The adapter and weight-update routes of one engine."""
    cfg, engine = ctx.config, ctx.engine

    async def json_req(request: Request) -> Any:
        return await json_body(request, cfg.max_request_bytes)

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
        req = LoadLoraAdapterRequest.parse(await json_req(request))
        adapter = await asyncio.to_thread(
            load_peft_adapter, req.lora_name, req.lora_path, engine.lora_targets
        )
        engine.put_adapter(adapter)
        return lora_reply(True)

    async def unload_lora(request: Request) -> Response:
        require_lora()
        req = UnloadLoraAdapterRequest.parse(await json_req(request))
        engine.adapters.remove(req.lora_name)
        return lora_reply(True)

    async def load_lora_from_tensors(request: Request) -> Response:
        require_lora()
        raw = await body_bytes(request, cfg.max_update_bytes)
        content_type = request.headers.get("content-type", "")

        def decode_check_load() -> dict[str, str]:
            payload = decode_adapter_payload(raw, content_type)
            checksums = verify_adapter_checksums(payload)  # before anything is loaded
            engine.load_adapter_tensors(payload.name, payload.config, payload.tensors)
            return checksums

        checksums = await asyncio.to_thread(decode_check_load)
        return JSONResponse(
            {
                "success": True,
                "error_message": "",
                "loaded_adapters": engine.adapters.names(),
                "checksums": checksums,
            }
        )

    # ---- weights -----------------------------------------------------------------------

    async def begin_update(request: Request) -> Response:
        req = WeightUpdateBegin.parse(await json_req(request))
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

        def decode_and_stage() -> BucketManifest:
            manifest = bucket_body_manifest(raw)  # unreadable: it names no update, 400 alone
            try:
                _, tensors = decode_bucket_body(raw)
            except WireFormatError as e:
                engine.fail_update(manifest.update_id, str(e))  # as the shm path does
                raise
            engine.add_bucket(manifest, tensors, owned=True)  # decoded from the body: ours
            return manifest

        return await bucket_reply(await asyncio.to_thread(decode_and_stage))

    async def update_from_shm(request: Request) -> Response:
        req = ShmBucketRequest.parse(await json_req(request))
        manifest = req.manifest

        def map_and_stage() -> None:
            try:
                view = shm.slot(req.shm_path, req.slot, req.slot_bytes)
                tensors = unpack_bucket(manifest, view)
            except WireFormatError as e:
                engine.fail_update(manifest.update_id, str(e))
                raise
            engine.add_bucket(manifest, tensors)

        await asyncio.to_thread(map_and_stage)
        return await bucket_reply(manifest)

    async def end_update(request: Request) -> Response:
        body = await json_req(request)
        update_id = str(body.get("update_id", "")) if isinstance(body, dict) else ""
        result, session = engine.finish_update(update_id)
        shm.release_unlinked()
        if result.success:
            # a lora session's adapter is built and checked here, while generation goes on
            adapter = await asyncio.to_thread(engine.session_adapter, session)
            await sched.call_exclusive(lambda: engine.commit(session, adapter))
        return JSONResponse(
            result.to_dict() | {"success": result.success, "message": result.message},
            status_code=200 if result.success else 400,
        )

    async def abort_update(request: Request) -> Response:
        body = await json_req(request)
        uid = body.get("update_id") if isinstance(body, dict) else None
        aborted = engine.abort_update(None if uid is None else str(uid))
        shm.release_unlinked()
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
        req = UpdateWeightsFromDiskRequest.parse(await json_req(request))
        if ctx.load_checkpoint is None:
            raise CheckpointError("this engine cannot reload checkpoints")
        version = req.weight_version  # SGLang's string already read as an int
        loader = ctx.load_checkpoint

        def read_and_check() -> dict[str, Any]:
            tensors = loader(req.model_path)  # the reader refuses NaN/Inf
            engine.check_full_state(tensors)  # names, dtypes, shapes: nothing changed yet
            return tensors

        # Read and checked in a thread while generation goes on; a refusal changes nothing.
        tensors = await asyncio.to_thread(read_and_check)
        await sched.call_exclusive(lambda: engine.load_full_state(tensors, version))
        return JSONResponse(
            {
                "success": True,
                "message": f"loaded {req.model_path}",
                "num_paused_requests": 0,
                "weight_version": engine.weight_version,
            }
        )

    async def weights_checksum(request: Request) -> Response:
        sha, towers = await sched.call_exclusive(engine.digests)
        return JSONResponse(
            {
                "sha256": sha,
                "tower_sha256": towers,
                "weight_version": engine.weight_version,
                "stale_tensors": len(engine.stale_tensors),
            }
        )

    async def memory_tags(request: Request) -> list[str] | None:
        raw = await body_bytes(request, cfg.max_request_bytes)
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

    async def release_memory(request: Request) -> Response:
        tags = await memory_tags(request)
        released = await sched.call_exclusive(lambda: engine.release_memory(tags))
        return JSONResponse(
            {"success": True, "message": f"released {released}", "released": released}
        )

    async def resume_memory(request: Request) -> Response:
        tags = await memory_tags(request)
        still = await sched.call_exclusive(lambda: engine.resume_memory(tags))
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

    def g(handler: Handler) -> Handler:
        return guard(handler, api_key=cfg.api_key, state_changing=True)

    return [
        Route("/weights_checksum", guard(weights_checksum, api_key=None), methods=["GET"]),
        Route("/load_lora_adapter", g(load_lora), methods=["POST"]),
        Route("/unload_lora_adapter", g(unload_lora), methods=["POST"]),
        Route("/load_lora_adapter_from_tensors", g(load_lora_from_tensors), methods=["POST"]),
        Route("/update_weights_from_disk", g(update_from_disk), methods=["POST"]),
        Route("/begin_weight_update", g(begin_update), methods=["POST"]),
        Route("/update_weights_from_safetensors", g(update_from_safetensors), methods=["POST"]),
        Route("/update_weights_from_shm", g(update_from_shm), methods=["POST"]),
        Route("/end_weight_update", g(end_update), methods=["POST"]),
        Route("/abort_weight_update", g(abort_update), methods=["POST"]),
        Route("/release_memory_occupation", g(release_memory), methods=["POST"]),
        Route("/resume_memory_occupation", g(resume_memory), methods=["POST"]),
    ]
