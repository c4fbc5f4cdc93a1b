"""OpenAI-shaped replies built from an SGLang ``/generate`` reply, and the one-chunk fake stream.

Upstream is never streamed (TITO needs the whole reply, and SGLang rejects meta info with
streaming), so ``stream: true`` is answered with a single ``chat.completion.chunk`` SSE event
carrying the whole message, its finish reason and usage, followed by ``data: [DONE]``. OpenAI
SDKs accept this as an ordinary stream.

``choices[0].meta_info`` carries the engine's meta info (token ids and logprobs) so a client can
check token-in/token-out itself; bulky replay arrays (``routed_experts``, ``indexer_topk``) are
stripped from the client's copy (the session record keeps them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from posttrain.session_router.template import ChatTokenizer
from posttrain.session_router.tito import ParsedReply

CLIENT_STRIPPED_META = ("routed_experts", "indexer_topk")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def dumps(obj: Any) -> bytes:
    """Compact JSON, non-ASCII kept as UTF-8 (orjson: non-string keys become strings, as in json)."""
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def chat_completion(
    reply: ParsedReply,
    *,
    body: Mapping[str, Any],
    prompt_tokens: int,
    tok: ChatTokenizer,
) -> dict[str, Any]:
    """The ``chat.completion`` object for one turn."""
    meta = {k: v for k, v in reply.meta_info.items() if k not in CLIENT_STRIPPED_META}
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": reply.text},
        "logprobs": None,
        "finish_reason": reply.finish_reason,
        "meta_info": meta,
    }
    if body.get("logprobs"):
        choice["logprobs"] = {
            "content": [
                {"token": tok.token_text(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(reply.output_ids, reply.output_logprobs, strict=True)
            ]
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model") or "posttrain"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(reply.output_ids),
            "total_tokens": prompt_tokens + len(reply.output_ids),
        },
    }


def text_completion(
    reply: ParsedReply,
    *,
    body: Mapping[str, Any],
    prompt_tokens: int,
    tok: ChatTokenizer,
) -> dict[str, Any]:
    """The ``text_completion`` object for one raw-prompt turn (the chat one's fields, with
    ``text`` in place of ``message``)."""
    chat = chat_completion(reply, body=body, prompt_tokens=prompt_tokens, tok=tok)
    choice = dict(chat["choices"][0])
    choice["text"] = choice.pop("message")["content"]
    if body.get("logprobs"):
        content = choice["logprobs"]["content"]
        choice["logprobs"] = {
            "tokens": [c["token"] for c in content],
            "token_logprobs": [c["logprob"] for c in content],
        }
    return {**chat, "id": f"cmpl-{chat['id'][8:]}", "object": "text_completion",
            "choices": [choice]}  # fmt: skip


def fake_stream(completion: Mapping[str, Any]) -> bytes:
    """The whole SSE body for a non-streamed completion: one chunk, then ``[DONE]``."""
    choice = completion["choices"][0]
    if completion["object"] == "text_completion":  # completions stream the choice as it is
        chunk = {**completion, "choices": [dict(choice)]}
        return b"data: " + dumps(chunk) + b"\n\ndata: [DONE]\n\n"
    chunk = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
        "choices": [
            {
                "index": 0,
                "delta": dict(choice["message"]),
                "logprobs": choice["logprobs"],
                "finish_reason": choice["finish_reason"],
            }
        ],
        "usage": completion["usage"],
    }
    return b"data: " + dumps(chunk) + b"\n\ndata: [DONE]\n\n"
