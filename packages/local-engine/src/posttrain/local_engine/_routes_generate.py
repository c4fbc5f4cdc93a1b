"""Routes that generate: ``POST /generate`` and ``POST /v1/chat/completions``.

Both take SGLang's bodies (``posttrain.interface``' ``GenerateRequest`` and
``ChatCompletionRequest``), including ``image_data`` / ``audio_data`` for multimodal checkpoints
(``_requests.prompt_media``), and answer SGLang's JSON (``meta_info`` with the logprobs and the
weight version). The event loop only routes: a body over ``INLINE_BODY_BYTES`` is decoded,
validated and tokenized in a thread, a request naming media is prepared in the media pool, and
generation runs on the scheduler's worker thread. A batch larger than ``max_queued_requests``
is refused whole (413), before any of it is queued.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from posttrain.interface import (
    ChatCompletionRequest,
    GenerateRequest,
    SamplingParams,
    WireFormatError,
)
from posttrain.local_engine._context import ServerContext
from posttrain.local_engine._engine import GenResult, GenTask
from posttrain.local_engine._errors import RequestTooLargeError
from posttrain.local_engine._http import body_bytes, decode_json, guard, off_loop_if_large
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
    tasks_from_generate,
)
from posttrain.local_engine._scheduler import BatchScheduler
from posttrain.models import MediaBatch

__all__ = ["GenerationRoutes"]


class GenerationRoutes:
    """The generation routes of one engine (``routes()`` mounts them)."""

    def __init__(
        self,
        ctx: ServerContext,
        sched: BatchScheduler[GenTask, GenResult],
        media: MediaPool,
        next_seed: Callable[[], int],
    ) -> None:
        self.ctx, self.sched, self.media, self.next_seed = ctx, sched, media, next_seed

    async def run_tasks(self, tasks: list[GenTask]) -> list[GenResult]:
        engine, limit = self.ctx.engine, self.ctx.config.max_queued_requests
        engine.check_available()
        for i, t in enumerate(tasks):
            engine.validate(t, f"[{i}] " if len(tasks) > 1 else "")
        if len(tasks) > limit:
            raise RequestTooLargeError(
                f"input_ids: a batch of {len(tasks)} prompts exceeds max_queued_requests {limit}",
                field="input_ids",
            )
        return await self.sched.submit(tasks)

    def output_text(self, res: GenResult, skip_special: bool) -> str:
        codec = self.ctx.codec
        if codec is None:
            return ""
        text = codec.decode(res.output_ids, skip_special_tokens=skip_special)
        return text[: len(text) - res.trim_chars] if res.trim_chars else text

    def token_text(self, tok: int) -> str | None:
        return _tok_str(self.ctx.codec, tok)

    async def generate(self, request: Request) -> Response:
        ctx, engine = self.ctx, self.ctx.engine
        t0 = time.perf_counter()
        raw = await body_bytes(request, ctx.config.max_request_bytes)
        req = await off_loop_if_large(
            raw, lambda: GenerateRequest.parse(drop_neutral_sglang_keys(decode_json(raw)))
        )

        def prepare() -> tuple[list[GenTask], list[dict[str, Any]]]:
            return tasks_from_generate(
                req,
                codec=ctx.codec,
                next_seed=self.next_seed,
                max_context=engine.max_context,
                model_config=engine.model.config,
                media_files=self.media.files,
                max_tasks=ctx.config.max_queued_requests,
            )

        if req.image_data is not None or req.audio_data is not None:
            tasks, options = await self.media.run(prepare, field=_media_field(req))
        else:
            tasks, options = await off_loop_if_large(raw, prepare)
        results = await self.run_tasks(tasks)
        dt = time.perf_counter() - t0
        items = [
            {
                "text": self.output_text(r, o["skip_special_tokens"]),
                "output_ids": r.output_ids,
                "meta_info": meta_info(
                    r,
                    token_text=self.token_text if o["return_text_in_logprobs"] else _no_text,
                    e2e_latency=dt,
                ),
            }
            for r, o in zip(results, options, strict=True)
        ]
        # SGLang answers a list for a batch and for n > 1 (parallel samples of one prompt).
        return JSONResponse(items if req.is_batch or len(items) > 1 else items[0])

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], MediaBatch | None]:
        codec, engine = self.ctx.codec, self.ctx.engine
        if req.input_ids is not None:
            ids = list(req.input_ids)
        else:
            if codec is None:
                raise WireFormatError("messages: this model has no chat template", field="messages")
            msgs = [m.model_dump(exclude_none=True) for m in req.messages]
            text = codec.chat_text(msgs, **(req.chat_template_kwargs or {}))
            check_text_fits(codec, text, engine.max_context, field="messages")
            ids = codec.encode(text)
        images = media_refs(req.image_data, 0, 1, "image_data", False)
        audio = media_refs(req.audio_data, 0, 1, "audio_data", False)
        return prompt_media(ids, images, audio, engine.model.config, files=self.media.files)

    def chat_task(
        self, req: ChatCompletionRequest, ids: list[int], items: MediaBatch | None
    ) -> GenTask:
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
        scfg, seed, extra = sampling_from_params(sp, default_seed=self.next_seed())
        return GenTask(
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

    async def chat(self, request: Request) -> Response:
        t0 = time.perf_counter()
        raw = await body_bytes(request, self.ctx.config.max_request_bytes)
        req = await off_loop_if_large(raw, lambda: _chat_request(raw))
        if req.image_data is not None or req.audio_data is not None:
            ids, items = await self.media.run(
                lambda: self.chat_prompt(req), field=_media_field(req)
            )
        else:
            ids, items = await off_loop_if_large(raw, lambda: self.chat_prompt(req))
        (res,) = await self.run_tasks([self.chat_task(req, ids, items)])
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": self.output_text(res, True)},
            "finish_reason": res.finish_reason.get("type"),
            "matched_stop": res.finish_reason.get("matched"),
        }
        if req.logprobs and res.output_token_logprobs is not None:
            choice["logprobs"] = _chat_logprobs(self.ctx.codec, res)
        if req.return_meta_info:
            choice["meta_info"] = meta_info(
                res, token_text=_no_text, e2e_latency=time.perf_counter() - t0
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

    def routes(self) -> list[Route]:
        key = self.ctx.config.api_key
        return [
            Route("/generate", guard(self.generate, api_key=key), methods=["POST"]),
            Route("/v1/chat/completions", guard(self.chat, api_key=key), methods=["POST"]),
        ]


def _chat_request(raw: bytes) -> ChatCompletionRequest:
    req = ChatCompletionRequest.parse(decode_json(raw))
    if req.stream:
        raise WireFormatError("stream: streaming is not supported by local-engine", field="stream")
    return req


def _chat_logprobs(codec: TextCodec | None, res: GenResult) -> dict[str, Any]:
    """OpenAI's ``choices[0].logprobs`` of a chat reply: each token with its top alternatives."""
    token_logprobs = res.output_token_logprobs or []
    tops = res.output_top_logprobs or [None] * len(token_logprobs)
    return {
        "content": [
            {
                "token": _tok_str(codec, tok),
                "logprob": json_logprob(lp),
                "bytes": list(_tok_str(codec, tok).encode()),
                "top_logprobs": [
                    {
                        "token": _tok_str(codec, t),
                        "logprob": json_logprob(v),
                        "bytes": list(_tok_str(codec, t).encode()),
                    }
                    for v, t in (top or [])
                ],
            }
            for (lp, tok), top in zip(token_logprobs, tops, strict=True)
        ]
    }


def _no_text(tok: int) -> str | None:
    return None


def _media_field(req: GenerateRequest | ChatCompletionRequest) -> str:
    return "image_data" if req.image_data is not None else "audio_data"


def _tok_str(codec: TextCodec | None, tok: int) -> str:
    if codec is None:
        return f"<{tok}>"
    return codec.decode([tok], skip_special_tokens=False)
