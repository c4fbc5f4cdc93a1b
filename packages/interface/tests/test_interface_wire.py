"""SGLang wire types: exact JSON round trips, and validation errors that name the bad field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.interface import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    GenerateRequest,
    GenerateResponse,
    LoadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    WireFormatError,
    WireModel,
)

token = st.integers(min_value=0, max_value=200_000)
logprob = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)
entry = st.one_of(
    st.tuples(st.one_of(st.none(), logprob), token).map(list),
    st.tuples(st.one_of(st.none(), logprob), token, st.one_of(st.none(), st.text(max_size=3))).map(
        list
    ),
)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0.01, max_value=1.0),
        "top_k": st.one_of(st.just(-1), st.integers(1, 50)),
        "max_new_tokens": st.integers(0, 64),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
        "stop_token_ids": st.lists(token, max_size=3),
        "seed": st.integers(0, 2**31),
        "no_stop_trim": st.booleans(),
    },
)


@st.composite
def generate_requests(draw: st.DrawFn) -> dict[str, Any]:
    ids = draw(st.lists(token, min_size=1, max_size=6))
    body: dict[str, Any] = {"input_ids": ids}
    optional = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "sampling_params": sampling,
                "return_logprob": st.booleans(),
                "logprob_start_len": st.integers(-1, 5),
                "top_logprobs_num": st.integers(0, 8),
                "lora_path": st.text(min_size=1, max_size=6),
                "rid": st.text(min_size=1, max_size=6),
            },
        )
    )
    body.update(optional)
    mode = draw(st.sampled_from(["none", "flat", "positions"]))
    if mode == "flat":
        body["token_ids_logprob"] = draw(st.lists(token, max_size=4))
    elif mode == "positions":
        body["token_ids_logprob_positions"] = [draw(st.lists(token, max_size=3)) for _ in ids]
    return body


@st.composite
def generate_responses(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 4))
    meta: dict[str, Any] = {
        "id": draw(st.text(min_size=1, max_size=5)),
        "finish_reason": draw(
            st.one_of(
                st.none(),
                st.fixed_dictionaries({"type": st.just("stop"), "matched": token}),
                st.fixed_dictionaries({"type": st.just("length"), "length": st.integers(0, 9)}),
            )
        ),
        "prompt_tokens": draw(st.integers(1, 9)),
        "completion_tokens": n,
        "weight_version": draw(st.one_of(st.none(), st.integers(0, 10**6))),
        "output_token_logprobs": draw(st.lists(entry, min_size=n, max_size=n)),
        "output_top_logprobs": draw(
            st.lists(st.one_of(st.none(), st.lists(entry, max_size=3)), min_size=n, max_size=n)
        ),
        "input_token_logprobs": draw(st.lists(entry, max_size=4)),
    }
    return {
        "text": draw(st.text(max_size=8)),
        "output_ids": draw(st.lists(token, max_size=n)),
        "meta_info": meta,
    }


def _round_trip(model_type: type[WireModel], data: dict[str, Any]) -> None:
    first = model_type.parse(data)
    text = first.to_json()
    second = model_type.from_json(text)
    assert second == first
    assert second.to_json() == text
    assert json.loads(text) == first.to_dict()


@settings(max_examples=60, deadline=None)
@given(body=generate_requests())
def test_generate_request_round_trip(body: dict[str, Any]) -> None:
    _round_trip(GenerateRequest, body)
    assert json.loads(GenerateRequest.parse(body).to_json())["input_ids"] == body["input_ids"]


@settings(max_examples=60, deadline=None)
@given(body=generate_responses())
def test_generate_response_round_trip(body: dict[str, Any]) -> None:
    _round_trip(GenerateResponse, body)
    parsed = GenerateResponse.parse(body)
    # 2- and 3-element entries keep their arity, floats keep every bit.
    assert [list(e) for e in parsed.meta_info.output_token_logprobs or []] == body["meta_info"][
        "output_token_logprobs"
    ]


def test_chat_round_trip_and_unknown_keys_kept() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "max_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": False},
        "vendor_extension": {"x": 1},
    }
    _round_trip(ChatCompletionRequest, body)
    assert ChatCompletionRequest.parse(body).to_dict()["vendor_extension"] == {"x": 1}
    reply = {
        "id": "c1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "yo"},
                "finish_reason": "stop",
                "meta_info": {"output_token_logprobs": [[-0.5, 3, None]]},
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
    _round_trip(ChatCompletionResponse, reply)


BAD_FIELDS: list[tuple[type[WireModel], dict[str, Any], str]] = [
    (GenerateRequest, {"input_ids": [1, -1]}, "input_ids"),
    (GenerateRequest, {"input_ids": [1], "lora_name": "a"}, "lora_name"),
    (
        GenerateRequest,
        {"input_ids": [1], "sampling_params": {"temperature": -1}},
        "sampling_params",
    ),
    (GenerateRequest, {"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params"),
    (GenerateRequest, {"input_ids": [1], "top_logprobs_num": -2}, "top_logprobs_num"),
    (GenerateRequest, {"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    (
        GenerateResponse,
        {"text": "", "meta_info": {"output_token_logprobs": [[-0.1, -3]]}},
        "meta_info.output_token_logprobs",
    ),
    (
        GenerateResponse,
        {"text": "", "meta_info": {"finish_reason": {"type": "eos"}}},
        "meta_info.finish_reason.type",
    ),
    (GenerateResponse, {"meta_info": {}}, "text"),
    (ChatCompletionRequest, {"messages": []}, "messages"),
    (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (LoadLoraAdapterRequest, {"lora_name": "", "lora_path": "/a"}, "lora_name"),
    (UpdateWeightsFromDiskRequest, {}, "model_path"),
]


@pytest.mark.parametrize(("model_type", "data", "field"), BAD_FIELDS)
def test_validation_errors_name_the_field(
    model_type: type[WireModel], data: dict[str, Any], field: str
) -> None:
    with pytest.raises(WireFormatError) as info:
        model_type.parse(data)
    assert info.value.field is not None
    assert info.value.field.startswith(field)
    assert field in str(info.value)


@settings(max_examples=40, deadline=None)
@given(body=generate_requests(), bad=st.sampled_from(["nan", "inf"]))
def test_non_finite_floats_rejected(body: dict[str, Any], bad: str) -> None:
    body = dict(body, sampling_params={"temperature": float(bad)})
    with pytest.raises(WireFormatError) as info:
        GenerateRequest.parse(body)
    assert info.value.field == "sampling_params.temperature"


def test_generate_request_cross_field_rules() -> None:
    with pytest.raises(WireFormatError, match="exactly one of text and input_ids"):
        GenerateRequest.parse({"text": "a", "input_ids": [1]})
    with pytest.raises(WireFormatError, match="exclusive"):
        GenerateRequest.parse(
            {"input_ids": [1], "token_ids_logprob": [1], "token_ids_logprob_positions": [[1]]}
        )
    with pytest.raises(WireFormatError, match="2 rows but input_ids has 1"):
        GenerateRequest.parse({"input_ids": [1], "token_ids_logprob_positions": [[], [1]]})
    batch = GenerateRequest.parse({"input_ids": [[1, 2], [3]], "lora_path": ["a", None]})
    assert batch.is_batch
    assert batch.batch_size == 2
    assert GenerateRequest.parse({"text": ["a", "b", "c"]}).batch_size == 3
    assert GenerateRequest.parse({"text": "a"}).batch_size == 1


def _entry(name: str, offset: int, shape: list[int], dtype: str = "bfloat16") -> dict[str, Any]:
    size = {"bfloat16": 2, "float32": 4}[dtype]
    n = 1
    for d in shape:
        n *= d
    return {"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": n * size}
