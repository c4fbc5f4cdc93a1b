"""Token-in/token-out state of one session: checkpoints, rollback, the prefix invariant.

A session keeps, per committed assistant turn, a checkpoint: the exact token ids the engine saw
and produced (``prompt + completion``), and the number of messages that turn closes. A new turn's
prompt is the last kept checkpoint plus the tokens of the *appended* messages only, so tokens the
engine generated are never re-tokenized.

* ``prepare_turn`` is pure: it compares the request's messages with the stored ones (a matcher),
  picks the checkpoint to continue from (rolling back at most ``max_rollback_checkpoints``; a retry
  of the first turn goes back to the empty checkpoint) and builds the prompt. It changes nothing.
* ``commit_turn`` applies the prepared turn if nothing committed since it was prepared (else the
  reply is returned but not recorded), after checking the prefix invariant
  ``new[:len(prev)-k] == prev[:len(prev)-k]`` (``k = max_trim_tokens``).

The session lock is held only around these two calls, never across the upstream request; a
failed upstream call therefore leaves the state exactly as it was, and the turn can be retried.

Junction between turns: the template renders a tail after assistant content (``<|im_end|>\\n``)
that the engine generated only partly (``<|im_end|>``); the missing tail tokens are appended, and
a trailing stop token the template does not render (a bare EOS) is trimmed (counted against
``max_trim_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.session_router._errors import (
    BadChatRequestError,
    TitoMismatchError,
    UpstreamReplyError,
)
from posttrain.session_router.template import ChatTokenizer

APPENDABLE_ROLES = frozenset({"user", "tool", "system"})
Matcher = Callable[[Mapping[str, Any], Mapping[str, Any]], bool]


def _tool_calls(msg: Mapping[str, Any], *, parse_args: bool) -> list[Any]:
    calls = msg.get("tool_calls") or []
    out = []
    for call in calls:
        if not isinstance(call, Mapping):
            out.append(call)
            continue
        item = {k: v for k, v in call.items() if k != "index"}
        fn = item.get("function")
        if parse_args and isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):
                item["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
        out.append(item)
    return out


def _strict(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (
        a.get("role") == b.get("role")
        and (a.get("content") or None) == (b.get("content") or None)
        and (a.get("reasoning_content") or None) == (b.get("reasoning_content") or None)
        and _tool_calls(a, parse_args=False) == _tool_calls(b, parse_args=False)
    )


def _loose_tool_call(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (
        a.get("role") == b.get("role")
        and (a.get("content") or None) == (b.get("content") or None)
        and (a.get("reasoning_content") or None) == (b.get("reasoning_content") or None)
        and _tool_calls(a, parse_args=True) == _tool_calls(b, parse_args=True)
    )


def _role_content_only(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or None) == (
        b.get("content") or None
    )


MATCHERS: Mapping[str, Matcher] = {
    "strict": _strict,
    "loose_tool_call": _loose_tool_call,
    "role_content_only": _role_content_only,
}


@dataclass(kw_only=True, slots=True)
class TurnRecord:
    """One committed turn: the full upstream request and reply, plus the parsed token lists."""

    timestamp: float
    request_timestamp: float
    method: str
    path: str
    request: dict[str, Any]
    response: dict[str, Any]
    status_code: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str

    def to_json(self) -> dict[str, Any]:
        """The record as ``GET /sessions/{id}`` shows it."""
        return {
            "timestamp": self.timestamp,
            "request_timestamp": self.request_timestamp,
            "method": self.method,
            "path": self.path,
            "request": self.request,
            "response": self.response,
            "status_code": self.status_code,
        }


@dataclass(kw_only=True, slots=True)
class SessionState:
    """Everything a session remembers; mutate only through ``commit_turn`` under ``lock``."""

    session_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[list[int]] = field(default_factory=list)
    ckpt_msg_ends: list[int] = field(default_factory=list)
    records: list[TurnRecord] = field(default_factory=list)
    # The adapter version its requests name in extra_key (None: the server's default).
    weight_version: int | None = None
    version: int = 0
    rollbacks: int = 0
    closing: bool = False
    mismatch: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def accumulated_token_ids(self) -> list[int]:
        """The token ids of the whole conversation so far (the last checkpoint)."""
        return list(self.checkpoints[-1]) if self.checkpoints else []


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedTurn:
    """What ``prepare_turn`` decided: the prompt and the state it was built against."""

    prompt_ids: list[int]
    keep_checkpoints: int
    version: int
    request_messages: list[dict[str, Any]]
    trimmed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedReply:
    """The parts of a ``/generate`` reply TITO uses."""

    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    meta_info: dict[str, Any]


def common_prefix_len(
    stored: Sequence[Mapping[str, Any]], requested: Sequence[Mapping[str, Any]], matcher: Matcher
) -> int:
    """Length of the longest prefix on which ``matcher`` accepts stored vs requested messages."""
    n = 0
    for a, b in zip(stored, requested, strict=False):
        verdict = matcher(a, b)
        if not isinstance(verdict, bool):
            raise TypeError(f"message matcher returned {type(verdict).__name__}, not bool")
        if not verdict:
            break
        n += 1
    return n


def prepare_turn(
    state: SessionState,
    messages: Sequence[Mapping[str, Any]],
    tok: ChatTokenizer,
    *,
    tools: Sequence[Any] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    matcher: str = "strict",
    max_rollback_checkpoints: int = 1,
    max_trim_tokens: int = 1,
    max_uncached_chars: int | None = None,
) -> PreparedTurn:
    """Choose the checkpoint to extend and build the turn's prompt ids (pure; raises 400s).

    ``max_uncached_chars`` is passed to ``ChatTokenizer.encode`` (``NotCachedError`` when a
    longer text would have to be tokenized).
    """
    request = [dict(m) for m in messages]
    m = common_prefix_len(state.messages, request, MATCHERS[matcher])
    keep = len(state.checkpoints)
    if m < len(state.messages):
        keep = 0
        for j, end in enumerate(state.ckpt_msg_ends):
            if end <= m:
                keep = j + 1
        discarded = len(state.checkpoints) - keep
        if discarded > max_rollback_checkpoints:
            raise BadChatRequestError(
                f"messages[{m}]: the request diverges from the session's history at message {m}, "
                f"which would discard {discarded} turns (at most {max_rollback_checkpoints} may be "
                "rolled back)"
            )
    if keep == 0:
        text = tok.render(
            request, add_generation_prompt=True, tools=tools, template_kwargs=template_kwargs
        )
        return PreparedTurn(
            prompt_ids=tok.encode(text, max_uncached_chars=max_uncached_chars),
            keep_checkpoints=0,
            version=state.version,
            request_messages=request,
            trimmed=0,
        )
    base_len = state.ckpt_msg_ends[keep - 1]
    appended = request[base_len:]
    if not appended:
        raise BadChatRequestError(
            f"messages: the request repeats the session's {base_len} messages and appends none"
        )
    for i, msg in enumerate(appended, start=base_len):
        if msg["role"] not in APPENDABLE_ROLES:
            raise BadChatRequestError(
                f"messages[{i}]: role {msg['role']!r} cannot be appended to a session (allowed: "
                f"{sorted(APPENDABLE_ROLES)}); assistant turns come only from the engine"
            )
    ckpt = state.checkpoints[keep - 1]
    output = state.records[keep - 1].output_ids
    tail = tok.assistant_tail_ids(template_kwargs)
    have = 0
    for n in range(min(len(tail), len(output)), 0, -1):
        if list(ckpt[len(ckpt) - n :]) == tail[:n]:
            have = n
            break
    trimmed = 0
    if have == 0 and output and output[-1] in tok.stop_token_ids and max_trim_tokens >= 1:
        trimmed = 1
    delta = tok.render_delta(
        appended,
        last_assistant=state.messages[base_len - 1],
        tools=tools,
        template_kwargs=template_kwargs,
    )
    prompt = (
        list(ckpt[: len(ckpt) - trimmed])
        + tail[have:]
        + tok.encode(delta, max_uncached_chars=max_uncached_chars)
    )
    return PreparedTurn(
        prompt_ids=prompt,
        keep_checkpoints=keep,
        version=state.version,
        request_messages=request,
        trimmed=trimmed,
    )


def prepare_raw_turn(state: SessionState, prompt_ids: Sequence[int]) -> PreparedTurn:
    """A raw-prompt turn (no chat template): ``prompt_ids`` as they are. On a session with
    turns they must continue its tokens (``accumulated_token_ids``); else a 400."""
    ids = list(prompt_ids)
    acc = state.accumulated_token_ids
    if ids[: len(acc)] != acc:
        raise BadChatRequestError(
            f"prompt: a raw turn must continue the session's {len(acc)} tokens (send its "
            "accumulated_token_ids followed by the new ones); open a new session otherwise"
        )
    return PreparedTurn(
        prompt_ids=ids,
        keep_checkpoints=len(state.checkpoints),
        version=state.version,
        request_messages=list(state.messages),
        trimmed=0,
    )


def parse_generate_reply(
    reply: Any, *, prompt_len: int, url: str, with_media: bool = False
) -> ParsedReply:
    """Validate a ``/generate`` reply for TITO; anything missing is an ``UpstreamReplyError`` (502).

    ``with_media``: the request carried ``image_data``/``audio_data``; the engine counts each
    media sentinel's placeholder run in ``prompt_tokens``, so it may exceed ``prompt_len``.
    """
    if isinstance(reply, list) and len(reply) == 1:
        reply = reply[0]
    if not isinstance(reply, dict):
        raise UpstreamReplyError(f"upstream reply is not a JSON object: {reply!r:.200}", url=url)
    meta = reply.get("meta_info")
    if not isinstance(meta, dict):
        raise UpstreamReplyError(
            "upstream reply has no meta_info (a router that drops return_logprob cannot serve "
            "token-in/token-out)",
            url=url,
        )
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise UpstreamReplyError(
            "upstream reply: meta_info.output_token_logprobs is missing", url=url
        )
    ids: list[int] = []
    logprobs: list[float] = []
    for i, entry in enumerate(entries):
        if (
            not isinstance(entry, list | tuple)
            or len(entry) < 2
            or not isinstance(entry[0], int | float)
            or isinstance(entry[1], bool)
            or not isinstance(entry[1], int)
        ):
            raise UpstreamReplyError(
                f"upstream reply: meta_info.output_token_logprobs[{i}] is not [logprob, token_id, text]",
                url=url,
            )
        logprobs.append(float(entry[0]))
        ids.append(int(entry[1]))
    completion = meta.get("completion_tokens")
    if completion != len(ids):
        raise UpstreamReplyError(
            f"upstream reply: meta_info.completion_tokens={completion!r} but "
            f"{len(ids)} output_token_logprobs",
            url=url,
        )
    prompt_tokens = meta.get("prompt_tokens")
    expanded = with_media and isinstance(prompt_tokens, int) and prompt_tokens > prompt_len
    if prompt_tokens is not None and prompt_tokens != prompt_len and not expanded:
        raise UpstreamReplyError(
            f"upstream reply: meta_info.prompt_tokens={prompt_tokens} but {prompt_len} input_ids were sent",
            url=url,
        )
    output_ids = reply.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise UpstreamReplyError(
            "upstream reply: output_ids disagree with meta_info.output_token_logprobs", url=url
        )
    text = reply.get("text")
    if not isinstance(text, str):
        raise UpstreamReplyError("upstream reply: text is missing or null", url=url)
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return ParsedReply(
        text=text,
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=str(reason or "stop"),
        meta_info=meta,
    )


def commit_turn(
    state: SessionState,
    prepared: PreparedTurn,
    reply: ParsedReply,
    record: TurnRecord,
    assistant_message: dict[str, Any],
    *,
    max_trim_tokens: int = 1,
) -> bool:
    """Record the turn unless the session closed or moved on; raise ``TitoMismatchError`` on a broken prefix.

    Returns whether the turn was committed.
    """
    if state.closing or state.version != prepared.version:
        return False
    prev = state.checkpoints[prepared.keep_checkpoints - 1] if prepared.keep_checkpoints else []
    new = prepared.prompt_ids + reply.output_ids
    check = max(0, len(prev) - max_trim_tokens)
    if len(new) < check or new[:check] != prev[:check]:
        index = next(
            (i for i in range(min(check, len(new))) if new[i] != prev[i]), min(check, len(new))
        )
        state.mismatch = f"turn {prepared.keep_checkpoints}: tokens differ at index {index}"
        raise TitoMismatchError(
            f"TITO prefix mismatch: the new turn's tokens differ from checkpoint "
            f"{prepared.keep_checkpoints - 1} at index {index}",
            index=index,
        )
    if prepared.keep_checkpoints < len(state.checkpoints):
        state.rollbacks += 1
    keep = prepared.keep_checkpoints
    del state.checkpoints[keep:], state.ckpt_msg_ends[keep:], state.records[keep:]
    state.checkpoints.append(new)
    state.ckpt_msg_ends.append(len(prepared.request_messages) + 1)
    state.records.append(record)
    state.messages = [*prepared.request_messages, assistant_message]
    state.version += 1
    return True
