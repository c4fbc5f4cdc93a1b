"""Routes that report on one engine: health, model and server info, the model list.

``GET /health`` answers 200 while the server runs; ``GET /health_generate`` runs a one-token
generation through the scheduler and answers 503 when the weights cannot generate (released,
or logprobs that are not finite). ``/model_info`` (``/get_model_info``), ``/server_info``
(``/get_server_info``) and ``/v1/models`` answer SGLang's JSON shapes, plus the engine's own
facts (weight version, adapters, memory state, counters). None of them changes state, so none
needs the bearer token.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import UnavailableError
from posttrain.local_engine._http import guard
from posttrain.local_engine._requests import sampling_from_params
from posttrain.local_engine._scheduler import BatchScheduler

__all__ = ["VERSION", "InfoRoutes"]

VERSION = "0.1.0"


class InfoRoutes:
    """The health and info routes of one engine (``routes()`` mounts them)."""

    def __init__(
        self,
        ctx: ServerContext,
        sched: BatchScheduler[GenTask, GenResult],
        *,
        max_running: int,
    ) -> None:
        self.ctx, self.sched, self.max_running = ctx, sched, max_running

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        engine = self.ctx.engine
        engine.check_available()
        task = GenTask(
            input_ids=[0],
            max_new_tokens=1,
            sampling=sampling_from_params(None, default_seed=0)[0],
            seed=0,
            return_logprob=True,
        )
        (res,) = await self.sched.submit([task])
        # Honest: weights that turn into NaN/Inf logprobs cannot generate, whatever the status.
        lps = [lp for lp, _ in res.output_token_logprobs or []]
        if not lps or not all(math.isfinite(lp) for lp in lps):
            raise UnavailableError(f"a one-token generation gave logprobs {lps}: not finite")
        return Response(status_code=200)

    async def model_info(self, request: Request) -> Response:
        ctx, cfg, engine = self.ctx, self.ctx.config, self.ctx.engine
        return JSONResponse(
            {
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
        )

    async def server_info(self, request: Request) -> Response:
        ctx, cfg, engine, sched = self.ctx, self.ctx.config, self.ctx.engine, self.sched
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
            "max_running_requests": self.max_running,
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
            "lora_capabilities": ["checksums", "replace"] if cfg.enable_lora else [],
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

    async def list_models(self, request: Request) -> Response:
        cfg, engine = self.ctx.config, self.ctx.engine
        created = int(self.ctx.started)
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

    def routes(self) -> list[Route]:
        key = self.ctx.config.api_key
        return [
            Route("/health", guard(self.health, api_key=key), methods=["GET"]),
            Route("/health_generate", guard(self.health_generate, api_key=key), methods=["GET"]),
            Route("/model_info", guard(self.model_info, api_key=key), methods=["GET"]),
            Route("/get_model_info", guard(self.model_info, api_key=key), methods=["GET"]),
            Route("/server_info", guard(self.server_info, api_key=key), methods=["GET"]),
            Route("/get_server_info", guard(self.server_info, api_key=key), methods=["GET"]),
            Route("/v1/models", guard(self.list_models, api_key=key), methods=["GET"]),
        ]
