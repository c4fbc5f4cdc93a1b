"""The LoRA request fields: one predicate, one builder, one writer of ``lora_path``/``extra_key``.

That the trainer's generate path and session-router's chat and raw ``/generate`` paths send
identical fields is shown in session-router's tests, which drive its real request assembly.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain.formats import (
    FormatsConfigError,
    LoraServing,
    apply_lora_fields,
    request_fields,
    serves_lora,
)
from posttrain.interface import ConfigError, GenerateRequest

names = st.text(min_size=1, max_size=8).filter(lambda s: "," not in s)
servings = st.builds(LoraServing, adapter_name=st.none() | names, train_only=st.booleans())


def test_serves_lora_only_a_named_adapter_that_is_not_train_only() -> None:
    assert serves_lora(LoraServing(adapter_name="policy"))
    assert not serves_lora(LoraServing(adapter_name="policy", train_only=True))
    assert not serves_lora(LoraServing(adapter_name=None))
    assert request_fields("policy", 3) == {"lora_path": "policy", "extra_key": "policy:v3"}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: request_fields("", 1), "adapter name must be non-empty"),
        (lambda: request_fields("a", -1), "version must be a non-negative int, got -1"),
        (lambda: request_fields("a", "3"), "version must be a non-negative int, got '3'"),
        (lambda: LoraServing(adapter_name=""), "one non-empty adapter name"),
        (lambda: LoraServing(adapter_name="a,b"), "one non-empty adapter name"),
        (lambda: apply_lora_fields({}, LoraServing(adapter_name="a"), None), "weight version"),
    ],
)
def test_bad_arguments_are_config_errors(call: Any, message: str) -> None:
    with pytest.raises(FormatsConfigError, match=message) as info:
        call()
    assert isinstance(info.value, ConfigError)


@given(
    serving=servings,
    version=st.integers(0, 2**40),
    stray=st.dictionaries(st.sampled_from(["lora_path", "extra_key"]), st.text(max_size=4)),
)
def test_apply_sets_exactly_the_served_fields_and_drops_a_clients(
    serving: LoraServing, version: int, stray: dict[str, str]
) -> None:
    body: dict[str, Any] = {"input_ids": [1, 2], **stray}
    out = apply_lora_fields(body, serving, version)
    assert out is body
    lora = {k: v for k, v in out.items() if k in ("lora_path", "extra_key")}
    if serves_lora(serving):
        assert serving.adapter_name is not None
        assert lora == request_fields(serving.adapter_name, version)
    else:
        assert lora == {}
    GenerateRequest.parse(out)  # what an engine accepts
