"""The sample data model validates on construction and round-trips through JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.interface import (
    ConfigError,
    PositionScores,
    Sample,
    SampleGroup,
    SampleStatus,
    TeacherScores,
)

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(min_value=0, max_value=8))
    return Sample(
        prompt_ids=draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=8)),
        response_ids=draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
        rollout_logprobs=draw(st.lists(finite, min_size=n, max_size=n)),
        loss_mask=draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
        reward=draw(st.one_of(st.none(), finite)),
        status=draw(st.sampled_from(list(SampleStatus))),
        weight_version=draw(st.one_of(st.none(), st.integers(min_value=0, max_value=2**40))),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
        group_index=draw(st.one_of(st.none(), st.integers(0, 9))),
        index=draw(st.one_of(st.none(), st.integers(0, 9))),
    )


@settings(max_examples=100, deadline=None)
@given(sample=samples())
def test_sample_json_round_trip(sample: Sample) -> None:
    again = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert again == sample
    assert again.tokens == sample.prompt_ids + sample.response_ids
    assert again.response_length == len(sample.response_ids)


def _sample(**overrides: object) -> Sample:
    fields: dict[str, object] = {
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "rollout_logprobs": [-0.5, -1.0],
        "loss_mask": [1, 1],
    }
    fields.update(overrides)
    return Sample(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout_logprobs": [-0.5]}, "rollout_logprobs has 1 entries but response_ids has 2"),
        ({"loss_mask": [1]}, "loss_mask has 1 entries but response_ids has 2"),
        ({"loss_mask": [1, 2]}, r"loss_mask\[1\] must be 0 or 1"),
        ({"prompt_ids": [1, -2]}, r"prompt_ids\[1\] must be a non-negative int"),
        ({"rollout_logprobs": [-0.5, float("nan")]}, r"rollout_logprobs\[1\] must be a finite"),
        ({"reward": float("inf")}, "reward"),
        ({"status": "done"}, "status must be one of completed, truncated, aborted"),
        ({"weight_version": "3"}, "weight_version must be a non-negative int or None, got '3'"),
        ({"weight_version": -1}, "weight_version must be a non-negative int"),
        ({"weight_version": True}, "weight_version must be a non-negative int"),
    ],
)
def test_sample_rejects_bad_fields(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _sample(**overrides)


def test_sample_from_dict_rejects_unknown_fields() -> None:
    data = _sample().to_dict() | {"rewards": 1.0}
    with pytest.raises(ConfigError, match="unknown Sample field"):
        Sample.from_dict(data)


def test_sample_group() -> None:
    group = SampleGroup(group_index=3, samples=[_sample(reward=1.0), _sample(reward=0.0)])
    assert group.rewards() == [1.0, 0.0]
    assert len(group) == 2
    with pytest.raises(ConfigError, match=r"samples\[1\] has no reward"):
        SampleGroup(group_index=0, samples=[_sample(reward=1.0), _sample()]).rewards()
    with pytest.raises(ConfigError, match=r"samples\[1\] has a different prompt"):
        SampleGroup(group_index=0, samples=[_sample(), _sample(prompt_ids=[9])])
    with pytest.raises(ConfigError, match="has no samples"):
        SampleGroup(group_index=0, samples=[])


def test_teacher_scores() -> None:
    row = PositionScores(token_ids=[5, 7], logprobs=[-0.1, -2.5])
    assert row.as_dict() == {5: -0.1, 7: -2.5}
    scores = TeacherScores(teacher_name="t", sampled_logprobs=[-0.2, -0.3], positions=[row, row])
    assert scores.response_length == 2
    with pytest.raises(ConfigError, match="2 sampled_logprobs but 1 positions"):
        TeacherScores(teacher_name="t", sampled_logprobs=[-0.2, -0.3], positions=[row])
    with pytest.raises(ConfigError, match="repeat an id"):
        PositionScores(token_ids=[5, 5], logprobs=[-1.0, -1.0])
    with pytest.raises(ConfigError, match="2 token_ids but 1 logprobs"):
        PositionScores(token_ids=[5, 6], logprobs=[-1.0])
    with pytest.raises(ConfigError, match="teacher_name"):
        TeacherScores(teacher_name="")
