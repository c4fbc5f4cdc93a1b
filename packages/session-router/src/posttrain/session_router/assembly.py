"""Pure request assembly: an OpenAI chat body becomes an SGLang ``/generate`` body.

The stock sgl-router re-serializes chat requests and drops ``input_ids`` and ``return_meta_info``,
so the session server renders the template itself and calls ``/generate`` with token ids, which
the router passes through. These functions hold no state and do no I/O (hypothesis tests them):

* ``parse_chat_body`` validates the JSON body (400 naming the field on anything malformed: a
  message that is not an object, a role outside ``MESSAGE_ROLES``, ``content`` null where only an
  assistant's tool call may omit it, non-text content parts, malformed ``tool_calls``);
* ``merge_template_kwargs`` merges per-request ``chat_template_kwargs`` over the launch defaults;
* ``build_generate_body`` maps OpenAI sampling fields into ``sampling_params``, keeps unknown keys,
  and then forces the fields TITO needs, so a client can never switch them off: ``input_ids`` (the
  TITO prompt), ``return_logprob``, ``logprob_start_len=-1``, ``return_text_in_logprobs=False``,
  ``sampling_params.no_stop_trim=False``, and the LoRA fields (``lora_path``, ``extra_key``)
  exactly as ``posttrain.formats.apply_lora_fields`` writes them for the trainer's generate path.
  ``stream``/``stream_options`` never go upstream (TITO needs the whole reply);
* media: SGLang's ``image_data`` / ``audio_data`` (a string or a list of strings each: base64,
  a ``data:`` URL or a file path) go upstream as lists with the strings unchanged, after a check
  that names the bad entry. They cover the whole conversation, like ``messages``: one item per
  media sentinel in the prompt (earlier turns' included), since a turn's ``input_ids`` hold them;
* ``forward_headers`` drops hop-by-hop headers and the client's credentials and adds the routing key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from posttrain.formats import apply_lora_fields
from posttrain.interface import ConfigError, media_from_request, media_request_fields
from posttrain.session_router._errors import BadChatRequestError
from posttrain.session_router.config import SessionRouterConfig

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# OpenAI chat roles a chat template can render; anything else is a 400 naming the message.
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool"})

# OpenAI (or SGLang-native) top-level name -> SGLang sampling_params name.
SAMPLING_ALIASES: Mapping[str, str] = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "seed": "sampling_seed",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
}
# Read by the session server itself (template rendering, reply shape); never forwarded.
CONSUMED_KEYS = frozenset(
    {
        "messages",
        "model",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "chat_template_kwargs",
        "n",
        "user",
        "text",
        "return_meta_info",
        "sampling_params",
        "prompt",
        "echo",
    }
)
FORCED_TOP_LEVEL = ("input_ids", "return_logprob", "logprob_start_len", "return_text_in_logprobs")
FORCED_SAMPLING = {"no_stop_trim": False}
HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "host",
        "authorization",
        "accept-encoding",
    }
)
# Dropped from upstream replies before they go back to the client (a duplicate ``Server``
# header breaks some HTTP clients; lengths and encodings are recomputed by our server).
REPLY_DROP_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "content-encoding", "server", "date", "connection"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """A validated chat request: what the template needs and the body for ``build_generate_body``."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    stream: bool
    template_kwargs: dict[str, Any]


def parse_chat_body(raw: bytes, defaults: Mapping[str, Any] | None = None) -> ChatRequest:
    """Parse and validate a chat completion body; every failure is a ``BadChatRequestError`` (400)."""
    body = _body_object(raw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadChatRequestError("messages: must be a non-empty list")
    for i, msg in enumerate(messages):
        _check_message(i, msg)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadChatRequestError("tools: must be a list")
    _one_choice(body)
    return ChatRequest(
        body=body,
        messages=messages,
        tools=tools,
        stream=bool(body.get("stream", False)),
        template_kwargs=merge_template_kwargs(body.get("chat_template_kwargs"), defaults),
    )


def parse_completion_body(raw: bytes, vocab_size: int) -> tuple[ChatRequest, str | list[int]]:
    """Parse an OpenAI completions body (a raw prompt: a text, or token ids below
    ``vocab_size``); the request (no messages) and the prompt. Failures are 400s naming the field.
    """
    body = _body_object(raw)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI's list of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadChatRequestError("prompt: must be a non-empty text or list of token ids")
    elif isinstance(prompt, list) and prompt:
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise BadChatRequestError(
                    f"prompt[{i}]: must be a token id in [0, {vocab_size}), got {t!r}"
                )
    else:
        raise BadChatRequestError(
            f"prompt: must be a non-empty text or list of token ids, got {_kind(prompt)}"
        )
    _one_choice(body)
    if body.get("echo"):
        raise BadChatRequestError("echo: not supported (the prompt is not returned)")
    request = ChatRequest(
        body=body, messages=[], tools=None, stream=bool(body.get("stream", False)),
        template_kwargs={},
    )  # fmt: skip
    return request, prompt


def _body_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (400 otherwise)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadChatRequestError(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise BadChatRequestError(
            f"invalid JSON body: expected an object, got {type(body).__name__}"
        )
    return body


def _one_choice(body: Mapping[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadChatRequestError(f"n: only 1 choice per turn is supported, got {n!r}")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_message(i: int, msg: Any) -> None:
    """Validate one OpenAI chat message in place (text parts are joined into one string).

    ``content`` must be a string or a list of text parts; only an assistant message that carries
    ``tool_calls`` may leave it null or out (as OpenAI allows). Chat templates index these fields
    without checking them, so a bad shape is refused here, naming the field, rather than failing
    inside the template.
    """
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise BadChatRequestError(f"{where}: must be an object, got {_kind(msg)}")
    role = msg.get("role")
    if role not in MESSAGE_ROLES:
        raise BadChatRequestError(
            f"{where}.role: must be one of {', '.join(sorted(MESSAGE_ROLES))}, got {role!r}"
        )
    tool_calls = msg.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise BadChatRequestError(f"{where}.tool_calls: only an assistant message has them")
        if not isinstance(tool_calls, list):
            raise BadChatRequestError(
                f"{where}.tool_calls: must be a list, got {_kind(tool_calls)}"
            )
        for j, call in enumerate(tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise BadChatRequestError(
                    f"{where}.tool_calls[{j}]: must be an object with a function.name string"
                )
            if not isinstance(fn.get("arguments", ""), str | dict):
                raise BadChatRequestError(
                    f"{where}.tool_calls[{j}].function.arguments: must be a string or an object"
                )
    content = msg.get("content")
    if content is None:
        if role != "assistant" or not tool_calls:
            raise BadChatRequestError(
                f"{where}.content: must be a string or a list of text parts, got null "
                "(only an assistant message with tool_calls may omit it)"
            )
    elif not isinstance(content, str):
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            msg["content"] = "".join(p["text"] for p in content)
        else:
            raise BadChatRequestError(
                f"{where}.content: must be a string or a list of text parts, got {_kind(content)}"
            )
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = msg.get(key)
        if value is not None and not isinstance(value, str):
            raise BadChatRequestError(f"{where}.{key}: must be a string, got {_kind(value)}")


def merge_template_kwargs(
    requested: Any, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Per-request ``chat_template_kwargs`` merged over launch defaults (the request wins)."""
    if requested is None:
        requested = {}
    if not isinstance(requested, dict):
        raise BadChatRequestError(
            f"chat_template_kwargs: must be an object, got {type(requested).__name__}"
        )
    return {**(defaults or {}), **requested}


def build_generate_body(
    body: Mapping[str, Any],
    cfg: SessionRouterConfig,
    prompt_ids: Sequence[int],
    *,
    weight_version: int | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body for one turn (pure; see the module docstring for the rules).

    ``weight_version`` is the session's adapter version (its ``extra_key``); falls back to
    ``cfg.lora_weight_version``.
    """
    explicit = body.get("sampling_params")
    if explicit is not None and not isinstance(explicit, dict):
        raise BadChatRequestError("sampling_params: must be an object")
    sampling: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in SAMPLING_ALIASES:
            if value is not None:
                sampling[SAMPLING_ALIASES[key]] = value
        elif key not in CONSUMED_KEYS:
            out[key] = value
    # max_completion_tokens is the newer OpenAI name; it wins over max_tokens when both are sent.
    if body.get("max_completion_tokens") is not None:
        sampling["max_new_tokens"] = body["max_completion_tokens"]
    sampling.update(explicit or {})
    sampling.update(FORCED_SAMPLING)
    top_logprobs = body.get("top_logprobs")
    if isinstance(top_logprobs, int) and top_logprobs > 0:
        out["top_logprobs_num"] = top_logprobs
    try:
        media = media_from_request(body)
    except ConfigError as exc:
        raise BadChatRequestError(str(exc)) from exc
    out.update(media_request_fields(media))
    out.update(
        input_ids=list(prompt_ids),
        sampling_params=sampling,
        return_logprob=True,
        logprob_start_len=-1,
        return_text_in_logprobs=False,
    )
    return apply_lora(out, cfg, weight_version)


def apply_lora(
    body: dict[str, Any], cfg: SessionRouterConfig, weight_version: int | None = None
) -> dict[str, Any]:
    """Set or remove ``lora_path`` and ``extra_key`` as ``posttrain.formats`` says for ``cfg``.

    Used by the chat path and by the raw ``/generate`` proxy, so both send exactly the fields
    the trainer's generate path sends. A served adapter without a version is a
    ``BadChatRequestError`` (400).
    """
    version = cfg.lora_weight_version if weight_version is None else weight_version
    try:
        apply_lora_fields(body, cfg.lora, version)
    except ConfigError as exc:
        raise BadChatRequestError(str(exc)) from exc
    return body


def forward_headers(
    headers: Mapping[str, str] | Sequence[tuple[str, str]], session_id: str
) -> dict[str, str]:
    """Client headers safe to forward upstream, plus the session's routing key."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    out = {
        name: value
        for name, value in items
        if name.lower() not in HOP_BY_HOP_HEADERS and name.lower() != ROUTING_KEY_HEADER.lower()
    }
    out[ROUTING_KEY_HEADER] = session_id
    return out
