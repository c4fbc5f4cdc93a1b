"""Routes that change the served base weights: SGLang's own weight-update routes.

Every route here but ``GET /weights_checksum`` is state-changing, so each is wrapped with the
bearer-token guard. The request bodies are SGLang's (``posttrain.formats``'
``_sglang_requests``):

- ``/init_weights_update_group`` joins the trainer's group over gloo at rank ``rank_offset``
  (nccl is refused by name on this CPU engine); a group of the same name joined before is left
  first (its trainer formed it again: it lost the old one), dropping any update begun in it;
  ``/destroy_weights_update_group`` leaves it and drops any update begun and not completed;
- ``/update_weights_from_distributed`` receives one bucket and stages it (one broadcast per
  tensor, or with ``load_format: "flattened_bucket"`` one broadcast of the bucket's bytes end
  to end, as SGLang's ``FlattenedTensorBucket`` lays them out); the bucket with
  ``flush_cache: true`` ends the update and commits it, all or nothing (``_update``);
- ``/update_weights_from_disk``, ``/update_weight_version``;
- ``/update_weights_from_tensor`` is refused by name: its payload carries pickled CUDA IPC
  handles, which this engine will not unpickle from the network.

Receiving, decoding, checking (shapes, checksums, finiteness) and staging run in threads,
never on the event loop; only the swap itself runs on the scheduler's worker thread,
between batches. A refused update answers 4xx and the engine keeps serving what it served.
``/weights_checksum`` answers the served weights' digest, plus ``tower_sha256``, the digest of
the media towers' tensors. The adapter routes are ``_routes_lora``'s, the memory release and
resume routes ``_routes_memory``'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.formats import (
    FLATTENED_BUCKET,
    DestroyWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReq,
    UpdateGroup,
    UpdateWeightsFromDistributedReq,
    UpdateWeightVersionReq,
    dtype_from_name,
    join_update_group,
    unflatten,
)
from posttrain.interface import UpdateWeightsFromDiskRequest, WireFormatError, parse_weight_version
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import CheckpointError, UpdateSessionError
from posttrain.local_engine._http import guard, json_body
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.local_engine._update import StagedUpdate

__all__ = ["WeightRoutes"]


class WeightRoutes:
    """The weight-update routes of one engine and the update groups it joined."""

    def __init__(self, ctx: ServerContext, sched: BatchScheduler[GenTask, GenResult]) -> None:
        self.ctx, self.sched = ctx, sched
        self.groups: dict[str, UpdateGroup] = {}  # joined update groups, by name
        self.pending: dict[str, StagedUpdate] = {}  # an update begun in a group, not yet ended

    async def json_req(self, request: Request) -> Any:
        return await json_body(request, self.ctx.config.max_request_bytes)

    async def init_group(self, request: Request) -> Response:
        req = InitWeightsUpdateGroupReq.parse(await self.json_req(request))
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
        stale = self.groups.pop(req.group_name, None)
        if stale is not None:  # the trainer forms the group again (it lost the old one)
            self.pending.pop(req.group_name, None)
            await asyncio.to_thread(stale.destroy)
        group = await asyncio.to_thread(
            join_update_group,
            master_address=req.master_address,
            master_port=req.master_port,
            rank=req.rank_offset,
            world_size=req.world_size,
            group_name=req.group_name,
            backend=req.backend,
            timeout_s=self.ctx.config.update_group_timeout_s,
        )
        self.groups[req.group_name] = group
        self.pending.pop(req.group_name, None)  # an update begun in an earlier group is dropped
        return JSONResponse({"success": True, "message": f"joined {req.group_name!r}"})

    async def destroy_group(self, request: Request) -> Response:
        req = DestroyWeightsUpdateGroupReq.parse(await self.json_req(request))
        group = self.groups.pop(req.group_name, None)
        if group is None:
            raise UpdateSessionError(f"group_name: {req.group_name!r} is not joined")
        dropped = self.pending.pop(req.group_name, None) is not None
        await asyncio.to_thread(group.destroy)
        note = "; an update begun and not completed was dropped" if dropped else ""
        return JSONResponse({"success": True, "message": f"left {req.group_name!r}{note}"})

    def bucket_dtypes(self, req: UpdateWeightsFromDistributedReq) -> tuple[list[torch.dtype], int]:
        """The bucket's dtypes and its size in bytes, once that passes ``--max-update-bytes``."""
        dtypes = [dtype_from_name(d, field=f"dtypes[{i}]") for i, d in enumerate(req.dtypes)]
        total = sum(
            torch.Size(shape).numel() * d.itemsize
            for shape, d in zip(req.shapes, dtypes, strict=True)
        )
        limit = self.ctx.config.max_update_bytes
        if total > limit:
            raise WireFormatError(
                f"shapes: the bucket holds {total} bytes, over --max-update-bytes {limit}",
                field="shapes",
            )
        return dtypes, total

    async def update_from_distributed(self, request: Request) -> Response:
        req = UpdateWeightsFromDistributedReq.parse(await self.json_req(request))
        group = self.groups.get(req.group_name)
        if group is None:
            raise UpdateSessionError(
                f"group_name: {req.group_name!r} is not joined (/init_weights_update_group)"
            )
        if req.load_format not in (None, FLATTENED_BUCKET):
            raise WireFormatError(
                f"load_format: {req.load_format!r} is not read by this engine (one broadcast "
                f"per tensor, or {FLATTENED_BUCKET!r}: one per bucket)",
                field="load_format",
            )
        flattened = req.load_format == FLATTENED_BUCKET
        version = parse_weight_version(req.weight_version)
        dtypes, total = self.bucket_dtypes(req)
        engine = self.ctx.engine
        if req.group_name not in self.pending:
            self.pending[req.group_name] = engine.new_update()
        update = self.pending[req.group_name]

        def receive_and_stage() -> None:
            if flattened:  # one broadcast of the bucket's bytes end to end (formats' layout)
                flat = torch.empty(total, dtype=torch.uint8)
                group.broadcast([flat])  # always received, even if the layout is refused next
                update.add(unflatten(req.names, dtypes, req.shapes, flat))
                return
            bufs = [torch.empty(s, dtype=d) for s, d in zip(req.shapes, dtypes, strict=True)]
            group.broadcast(bufs)  # always received: the trainer's broadcast must complete
            update.add(dict(zip(req.names, bufs, strict=True)))

        try:
            await asyncio.to_thread(receive_and_stage)
        finally:
            if req.flush_cache:  # the update's last bucket: it ends here, either way
                self.pending.pop(req.group_name, None)
        if not req.flush_cache:
            return JSONResponse({"success": True, "message": f"bucket {update.buckets - 1} staged"})
        tensors = await asyncio.to_thread(engine.served_tensors, update)
        await self.sched.call_exclusive(lambda: engine.commit_staged(update, version, tensors))
        return JSONResponse(
            {
                "success": True,
                "message": f"update complete: {len(update.staged)} tensors in "
                f"{update.buckets} buckets",
                "weight_version": engine.weight_version,
            }
        )

    async def update_from_tensor(self, request: Request) -> Response:
        raise UpdateSessionError(
            "/update_weights_from_tensor is refused by this CPU engine: its "
            "serialized_named_tensors carry pickled CUDA IPC handles, which it will not "
            "unpickle from the network; use /update_weights_from_distributed (gloo) or "
            "/update_weights_from_disk"
        )

    async def update_weight_version(self, request: Request) -> Response:
        req = UpdateWeightVersionReq.parse(await self.json_req(request))
        version = parse_weight_version(req.new_version, field="new_version")
        if version is None:
            raise WireFormatError("new_version: not a weight version", field="new_version")
        self.ctx.engine.set_weight_version(version)
        return JSONResponse(
            {"success": True, "message": f"weight version {version}", "weight_version": version}
        )

    async def update_from_disk(self, request: Request) -> Response:
        req = UpdateWeightsFromDiskRequest.parse(await self.json_req(request))
        engine, loader = self.ctx.engine, self.ctx.load_checkpoint
        if loader is None:
            raise CheckpointError("this engine cannot reload checkpoints")
        version = req.weight_version  # SGLang's string already read as an int

        def read_and_check() -> dict[str, Any]:
            tensors = loader(req.model_path)  # the reader refuses NaN/Inf
            engine.check_full_state(tensors)  # names, dtypes, shapes: nothing changed yet
            return tensors

        # Read and checked in a thread while generation goes on; a refusal changes nothing.
        tensors = await asyncio.to_thread(read_and_check)
        await self.sched.call_exclusive(lambda: engine.load_full_state(tensors, version))
        return JSONResponse(
            {
                "success": True,
                "message": f"loaded {req.model_path}",
                "num_paused_requests": 0,
                "weight_version": engine.weight_version,
            }
        )

    async def weights_checksum(self, request: Request) -> Response:
        engine = self.ctx.engine
        sha, towers = await self.sched.call_exclusive(engine.digests)
        return JSONResponse(
            {
                "sha256": sha,
                "tower_sha256": towers,
                "weight_version": engine.weight_version,
                "stale_tensors": len(engine.stale_tensors),
            }
        )

    def routes(self) -> list[Route]:
        key = self.ctx.config.api_key
        changing = [
            ("/update_weights_from_disk", self.update_from_disk),
            ("/init_weights_update_group", self.init_group),
            ("/destroy_weights_update_group", self.destroy_group),
            ("/update_weights_from_distributed", self.update_from_distributed),
            ("/update_weights_from_tensor", self.update_from_tensor),
            ("/update_weight_version", self.update_weight_version),
        ]
        return [
            Route("/weights_checksum", guard(self.weights_checksum, api_key=None), methods=["GET"]),
            *(
                Route(path, guard(handler, api_key=key, state_changing=True), methods=["POST"])
                for path, handler in changing
            ),
        ]
