"""Routes that change the served weights: SGLang's own weight-update and LoRA routes.

Split from ``_app`` to keep each module readable; ``create_app`` mounts these. Every
route here is state-changing, so each is wrapped with the bearer-token guard. The request
bodies are SGLang's (``posttrain.formats``' ``_sglang_requests``):

- ``/init_weights_update_group`` joins the trainer's group over gloo at rank ``rank_offset``
  (nccl is refused by name on this CPU engine); a group of the same name joined before is left
  first (its trainer formed it again: it lost the old one), dropping any update begun in it;
  ``/destroy_weights_update_group`` leaves it and drops any update begun and not completed;
- ``/update_weights_from_distributed`` receives one bucket and stages it; the bucket with
  ``flush_cache: true`` ends the update and commits it, all or nothing (``_update``);
- ``/update_weights_from_disk``, ``/update_weight_version``;
- ``/load_lora_adapter`` (a PEFT directory) and ``/load_lora_adapter_from_tensors`` (SGLang's
  per-TP-rank ``serialized_named_tensors``, read with a restricted unpickler: plain tensors by
  value, never code);
- ``/update_weights_from_tensor`` is refused by name: its payload carries pickled CUDA IPC
  handles, which this engine will not unpickle from the network.

Receiving, decoding, checking (shapes, checksums, finiteness) and staging run in threads,
never on the event loop; only the swap itself runs on the scheduler's worker thread,
between batches. A refused update answers 4xx and the engine keeps serving what it served.

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

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.formats import (
    DestroyWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterFromTensorsReq,
    UpdateGroup,
    UpdateWeightsFromDistributedReq,
    UpdateWeightVersionReq,
    decode_adapter_payload,
    dtype_from_name,
    join_update_group,
    verify_adapter_checksums,
)
from posttrain.interface import (
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    WireFormatError,
    parse_weight_version,
)
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import AdapterError, CheckpointError, UpdateSessionError
from posttrain.local_engine._http import Handler, body_bytes, decode_json, guard, json_body
from posttrain.local_engine._lora import load_peft_adapter
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.local_engine._update import StagedUpdate

__all__ = ["weight_routes"]


def weight_routes(ctx: ServerContext, sched: BatchScheduler[GenTask, GenResult]) -> list[Route]:
    """The adapter and weight-update routes of one engine."""
    cfg, engine = ctx.config, ctx.engine
    groups: dict[str, UpdateGroup] = {}  # joined update groups, by name
    pending: dict[str, StagedUpdate] = {}  # an update begun in a group and not yet ended

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

        def decode_check_load() -> dict[str, str]:
            req = LoadLoraAdapterFromTensorsReq.from_json(raw)
            payload = decode_adapter_payload(req)  # plain tensors only, never code
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

    async def init_group(request: Request) -> Response:
        req = InitWeightsUpdateGroupReq.parse(await json_req(request))
        if req.backend != "gloo":
            raise UpdateSessionError(
                f"backend: {req.backend!r} needs GPUs; this CPU engine joins update groups "
                "over gloo"
            )
        if req.rank_offset >= req.world_size:
            raise WireFormatError(
                f"rank_offset: {req.rank_offset} is outside a group of {req.world_size}",
                field="rank_offset",
            )
        stale = groups.pop(req.group_name, None)
        if stale is not None:  # the trainer forms the group again (it lost the old one)
            pending.pop(req.group_name, None)
            await asyncio.to_thread(stale.destroy)
        group = await asyncio.to_thread(
            join_update_group,
            master_address=req.master_address,
            master_port=req.master_port,
            rank=req.rank_offset,
            world_size=req.world_size,
            group_name=req.group_name,
            backend=req.backend,
            timeout_s=cfg.update_group_timeout_s,
        )
        groups[req.group_name] = group
        pending.pop(req.group_name, None)  # an update begun in an earlier group is dropped
        return JSONResponse({"success": True, "message": f"joined {req.group_name!r}"})

    async def destroy_group(request: Request) -> Response:
        req = DestroyWeightsUpdateGroupReq.parse(await json_req(request))
        group = groups.pop(req.group_name, None)
        if group is None:
            raise UpdateSessionError(f"group_name: {req.group_name!r} is not joined")
        dropped = pending.pop(req.group_name, None) is not None
        await asyncio.to_thread(group.destroy)
        note = "; an update begun and not completed was dropped" if dropped else ""
        return JSONResponse({"success": True, "message": f"left {req.group_name!r}{note}"})

    async def update_from_distributed(request: Request) -> Response:
        req = UpdateWeightsFromDistributedReq.parse(await json_req(request))
        group = groups.get(req.group_name)
        if group is None:
            raise UpdateSessionError(
                f"group_name: {req.group_name!r} is not joined (/init_weights_update_group)"
            )
        if req.load_format is not None:
            raise WireFormatError(
                f"load_format: {req.load_format!r} is not read by this engine (one broadcast "
                "per tensor)",
                field="load_format",
            )
        version = parse_weight_version(req.weight_version)
        dtypes = [dtype_from_name(d, field=f"dtypes[{i}]") for i, d in enumerate(req.dtypes)]
        total = sum(
            torch.Size(shape).numel() * torch.empty((), dtype=d).element_size()
            for shape, d in zip(req.shapes, dtypes, strict=True)
        )
        if total > cfg.max_update_bytes:
            raise WireFormatError(
                f"shapes: the bucket holds {total} bytes, over --max-update-bytes "
                f"{cfg.max_update_bytes}",
                field="shapes",
            )
        if req.group_name not in pending:
            pending[req.group_name] = engine.new_update()
        update = pending[req.group_name]

        def receive_and_stage() -> None:
            bufs = [torch.empty(s, dtype=d) for s, d in zip(req.shapes, dtypes, strict=True)]
            group.broadcast(bufs)  # always received: the trainer's broadcast must complete
            update.add(dict(zip(req.names, bufs, strict=True)))

        try:
            await asyncio.to_thread(receive_and_stage)
        finally:
            if req.flush_cache:  # the update's last bucket: it ends here, either way
                pending.pop(req.group_name, None)
        if not req.flush_cache:
            return JSONResponse({"success": True, "message": f"bucket {update.buckets - 1} staged"})
        tensors = await asyncio.to_thread(engine.served_tensors, update)
        await sched.call_exclusive(lambda: engine.commit_staged(update, version, tensors))
        return JSONResponse(
            {
                "success": True,
                "message": f"update complete: {len(update.staged)} tensors in "
                f"{update.buckets} buckets",
                "weight_version": engine.weight_version,
            }
        )

    async def update_from_tensor(request: Request) -> Response:
        raise UpdateSessionError(
            "/update_weights_from_tensor is refused by this CPU engine: its "
            "serialized_named_tensors carry pickled CUDA IPC handles, which it will not "
            "unpickle from the network; use /update_weights_from_distributed (gloo) or "
            "/update_weights_from_disk"
        )

    async def update_weight_version(request: Request) -> Response:
        req = UpdateWeightVersionReq.parse(await json_req(request))
        version = parse_weight_version(req.new_version, field="new_version")
        if version is None:
            raise WireFormatError("new_version: not a weight version", field="new_version")
        engine.set_weight_version(version)
        return JSONResponse(
            {"success": True, "message": f"weight version {version}", "weight_version": version}
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
        Route("/init_weights_update_group", g(init_group), methods=["POST"]),
        Route("/destroy_weights_update_group", g(destroy_group), methods=["POST"]),
        Route("/update_weights_from_distributed", g(update_from_distributed), methods=["POST"]),
        Route("/update_weights_from_tensor", g(update_from_tensor), methods=["POST"]),
        Route("/update_weight_version", g(update_weight_version), methods=["POST"]),
        Route("/release_memory_occupation", g(release_memory), methods=["POST"]),
        Route("/resume_memory_occupation", g(resume_memory), methods=["POST"]),
    ]
