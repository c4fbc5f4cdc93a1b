"""Routes that load and unload LoRA adapters: SGLang's ``/load_lora_adapter`` (a PEFT
directory), ``/unload_lora_adapter`` and ``/load_lora_adapter_from_tensors``.

``/load_lora_adapter_from_tensors`` takes SGLang's per-TP-rank ``serialized_named_tensors``,
read with a restricted unpickler (plain tensors by value, never code), and verifies the
adapter's checksums before anything is loaded; its reply carries them. Loading runs in a
thread, never on the event loop, and replaces an adapter of the same name atomically. Every
route here changes state (the bearer token guards them) and answers 400 naming the problem
when LoRA is disabled (``--enable-lora``).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.formats import (
    LoadLoraAdapterFromTensorsReq,
    decode_adapter_payload,
    verify_adapter_checksums,
)
from posttrain.interface import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._errors import AdapterError
from posttrain.local_engine._http import body_bytes, guard, json_body
from posttrain.local_engine._lora import load_peft_adapter

__all__ = ["LoraRoutes"]


class LoraRoutes:
    """The adapter routes of one engine (``routes()`` mounts them)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def reply(self, ok: bool, message: str = "") -> JSONResponse:
        return JSONResponse(
            {
                "success": ok,
                "error_message": message,
                "loaded_adapters": self.ctx.engine.adapters.names(),
            },
            status_code=200 if ok else 400,
        )

    def require_lora(self) -> None:
        if not self.ctx.config.enable_lora:
            raise AdapterError("LoRA is disabled: start the engine with --enable-lora")

    async def load_lora(self, request: Request) -> Response:
        self.require_lora()
        engine = self.ctx.engine
        req = LoadLoraAdapterRequest.parse(
            await json_body(request, self.ctx.config.max_request_bytes)
        )
        adapter = await asyncio.to_thread(
            load_peft_adapter, req.lora_name, req.lora_path, engine.lora_targets
        )
        engine.put_adapter(adapter)
        return self.reply(True)

    async def unload_lora(self, request: Request) -> Response:
        self.require_lora()
        req = UnloadLoraAdapterRequest.parse(
            await json_body(request, self.ctx.config.max_request_bytes)
        )
        self.ctx.engine.adapters.remove(req.lora_name)
        return self.reply(True)

    async def load_lora_from_tensors(self, request: Request) -> Response:
        self.require_lora()
        engine = self.ctx.engine
        raw = await body_bytes(request, self.ctx.config.max_update_bytes)

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

    def routes(self) -> list[Route]:
        key = self.ctx.config.api_key
        return [
            Route(path, guard(handler, api_key=key, state_changing=True), methods=["POST"])
            for path, handler in (
                ("/load_lora_adapter", self.load_lora),
                ("/unload_lora_adapter", self.unload_lora),
                ("/load_lora_adapter_from_tensors", self.load_lora_from_tensors),
            )
        ]
