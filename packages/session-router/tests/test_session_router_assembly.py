"""Request assembly: forced keys win, ``stream`` never goes upstream, LoRA fields as formats says.

The LoRA property test drives the chat path (``build_generate_body``), the raw ``/generate``
proxy (``apply_lora``) and the trainer's generate path (a ``GenerateRequest`` body completed by
``posttrain.formats.apply_lora_fields``) and shows all three send identical LoRA fields, with
LoRA on and off.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import LoraServing, apply_lora_fields, request_fields, serves_lora
from posttrain.interface import GenerateRequest, SamplingParams
from posttrain.session_router import (
    ROUTING_KEY_HEADER,
    BadChatRequestError,
    SessionRouterConfig,
    apply_lora,
    build_generate_body,
    forward_headers,
    merge_template_kwargs,
    parse_chat_body,
)
from posttrain.session_router.assembly import CONSUMED_KEYS, SAMPLING_ALIASES

json_scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
forced_attempts = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": st.lists(st.integers(0, 9), max_size=3),
        "return_logprob": st.booleans(),
        "logprob_start_len": st.integers(-3, 3),
        "return_text_in_logprobs": st.booleans(),
        "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}),
        "lora_path": st.text(max_size=4),
        "extra_key": st.text(max_size=4),
        "sampling_params": st.fixed_dictionaries(
            {}, optional={"no_stop_trim": st.booleans(), "temperature": st.floats(0, 2)}
        ),
        "max_tokens": st.integers(1, 50),
        "max_completion_tokens": st.integers(1, 50),
        "temperature": st.floats(0, 2),
    },
)
other_keys = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(
        lambda k: (
            k not in CONSUMED_KEYS
            and k not in SAMPLING_ALIASES
            and k not in ("lora_path", "extra_key")
            and k
            not in (
                "input_ids",
                "return_logprob",
                "logprob_start_len",
                "return_text_in_logprobs",
                "top_logprobs_num",
            )
        )
    ),
    json_values,
    max_size=4,
)


def _cfg(adapter: str | None, train_only: bool, version: int | None = None) -> SessionRouterConfig:
    return SessionRouterConfig(
        upstream_url="http://127.0.0.1:9",
        tokenizer="unused",
        lora_adapter=adapter,
        lora_train_only=train_only,
        lora_weight_version=version,
    )


def _lora(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k in ("lora_path", "extra_key")}


@settings(max_examples=25, deadline=None)
@given(
    forced=forced_attempts,
    others=other_keys,
    prompt=st.lists(st.integers(0, 1000), max_size=20),
    adapter=st.none() | st.sampled_from(["miles_lora", "a1"]),
    train_only=st.booleans(),
    version=st.integers(0, 100),
)
def test_build_generate_body_invariants(
    forced: dict[str, Any],
    others: dict[str, Any],
    prompt: list[int],
    adapter: str | None,
    train_only: bool,
    version: int,
) -> None:
    cfg = _cfg(adapter, train_only)
    body = {"messages": [{"role": "user", "content": "hi"}], **others, **forced}
    snapshot = json.dumps(body, sort_keys=True)
    out = build_generate_body(body, cfg, prompt, weight_version=version)
    assert json.dumps(body, sort_keys=True) == snapshot, "the input body must not be mutated"
    # Forced keys win over anything the client sent.
    assert out["input_ids"] == prompt
    assert out["return_logprob"] is True
    assert out["logprob_start_len"] == -1
    assert out["return_text_in_logprobs"] is False
    assert out["sampling_params"]["no_stop_trim"] is False
    # Streaming never goes upstream; messages are rendered here, not forwarded.
    assert "stream" not in out
    assert "stream_options" not in out
    assert "messages" not in out
    # The LoRA fields are present exactly when the adapter is served, and then name it.
    assert ("lora_path" in out) == serves_lora(cfg.lora)
    if serves_lora(cfg.lora):
        assert _lora(out) == {"lora_path": adapter, "extra_key": f"{adapter}:v{version}"}
    # Every other key is kept unchanged.
    for key, value in others.items():
        assert out[key] == value
    if "max_completion_tokens" in forced:
        assert out["sampling_params"]["max_new_tokens"] == forced["max_completion_tokens"]
    elif "max_tokens" in forced:
        assert out["sampling_params"]["max_new_tokens"] == forced["max_tokens"]
    assert json.loads(json.dumps(out)) == out


@settings(max_examples=60, deadline=None)
@given(
    adapter=st.none() | st.sampled_from(["miles_lora", "policy"]),
    train_only=st.booleans(),
    version=st.integers(0, 2**31),
    stray=st.fixed_dictionaries(
        {}, optional={"lora_path": st.text(max_size=4), "extra_key": st.text(max_size=4)}
    ),
    prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=8),
    max_new_tokens=st.integers(1, 64),
)
def test_generate_and_chat_paths_send_identical_lora_fields(
    adapter: str | None,
    train_only: bool,
    version: int,
    stray: dict[str, str],
    prompt: list[int],
    max_new_tokens: int,
) -> None:
    cfg = _cfg(adapter, train_only)
    serving = LoraServing(adapter_name=adapter, train_only=train_only)
    # The trainer's generate path: its own /generate body, completed by the formats builder.
    generate = GenerateRequest(
        input_ids=prompt,
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
        return_logprob=True,
    ).to_dict()
    generate = dict(apply_lora_fields({**generate, **stray}, serving, version))
    # The session paths: a chat turn, and the raw /generate proxy.
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_new_tokens}
    chat = build_generate_body({**chat_body, **stray}, cfg, prompt, weight_version=version)
    raw = apply_lora({"input_ids": prompt, **stray}, cfg, version)
    expected = request_fields(adapter, version) if adapter and not train_only else {}
    assert _lora(generate) == _lora(chat) == _lora(raw) == expected
    for body in (generate, chat, raw):
        GenerateRequest.parse(body)  # every path sends a body the engine accepts


def test_a_served_adapter_without_a_version_is_a_bad_request() -> None:
    with pytest.raises(BadChatRequestError, match="a weight version is required"):
        build_generate_body({}, _cfg("a", False), [1])
    # the server's startup version is the fallback; a session's own version wins
    assert build_generate_body({}, _cfg("a", False, 2), [1])["extra_key"] == "a:v2"
    assert apply_lora({}, _cfg("a", False, 2), 5)["extra_key"] == "a:v5"
    assert _lora(apply_lora({"lora_path": "client"}, _cfg("a", True))) == {}


@settings(max_examples=25, deadline=None)
@given(
    defaults=st.dictionaries(st.text(max_size=4), json_scalars, max_size=3),
    requested=st.dictionaries(st.text(max_size=4), json_scalars, max_size=3),
)
def test_template_kwargs_merge_request_over_defaults(
    defaults: dict[str, Any], requested: dict[str, Any]
) -> None:
    merged = merge_template_kwargs(requested, defaults)
    assert set(merged) == set(defaults) | set(requested)
    for key, value in requested.items():
        assert merged[key] == value
    for key in set(defaults) - set(requested):
        assert merged[key] == defaults[key]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "invalid JSON body"),
        (b"[1, 2]", "expected an object"),
        (b'{"messages": []}', "messages: must be a non-empty list"),
        (b'{"messages": [{"content": "x"}]}', "messages[0]"),
        (b'{"messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}',
            "chat_template_kwargs",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n: only 1"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": {}}', "tools"),
    ],
)
def test_parse_chat_body_rejects(raw: bytes, message: str) -> None:
    with pytest.raises(BadChatRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_chat_body(raw)


def test_parse_chat_body_flattens_text_parts_and_reads_stream() -> None:
    req = parse_chat_body(
        json.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
                "stream": True,
                "chat_template_kwargs": {"enable_thinking": False},
            }
        ).encode(),
        {"enable_thinking": True, "x": 1},
    )
    assert req.messages[0]["content"] == "ab"
    assert req.stream is True
    assert req.template_kwargs == {"enable_thinking": False, "x": 1}


def test_forward_headers_drops_hop_by_hop_and_credentials() -> None:
    out = forward_headers(
        [
            ("Host", "x"),
            ("Content-Length", "5"),
            ("Transfer-Encoding", "chunked"),
            ("Authorization", "Bearer secret"),
            ("Connection", "keep-alive"),
            ("X-Request-Id", "r1"),
            ("x-smg-routing-key", "spoofed"),
        ],
        "sess",
    )
    assert out == {"X-Request-Id": "r1", ROUTING_KEY_HEADER: "sess"}
