"""The pure scoring protocol: payload shape, per-position layout, reply validation, summaries."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.opd import (
    ScoringInputError,
    TeacherResponseError,
    build_score_payload,
    flat_token_ids,
    parse_score_response,
    per_position_ids,
    summarize_response,
)
from posttrain.opd.testing import TinyTeacher

TEACHER = TinyTeacher(vocab_size=64, dim=8, seed=3)


def test_per_position_layout_matches_response_slice() -> None:
    rows = [[5, 7], [9, 11]]
    pos = per_position_ids(rows, prompt_len=3)
    assert pos == [[], [], [], [5, 7], [9, 11]]
    assert pos[1:][-len(rows) :] == rows  # the same slice the reply is cut with
    assert per_position_ids([[4, 4, 2]], 1) == [[], [4, 2]]
    with pytest.raises(ScoringInputError, match="placeholder"):
        per_position_ids(rows, prompt_len=0)


def test_payload_carries_exactly_one_id_key() -> None:
    ids = [1, 2, 3, 4, 5]
    flat = build_score_payload(ids, top_k=3, token_ids=[9, 5, 9, 7])
    assert flat["token_ids_logprob"] == [5, 7, 9]
    assert "token_ids_logprob_positions" not in flat
    assert flat["top_logprobs_num"] == 3
    assert flat["sampling_params"] == {
        "temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False,
    }  # fmt: skip
    assert flat["return_logprob"] is True
    assert flat["logprob_start_len"] == 0
    pp = build_score_payload(ids, positions=per_position_ids([[5], [7, 9]], 3))
    assert "token_ids_logprob" not in pp
    assert "top_logprobs_num" not in pp
    assert pp["token_ids_logprob_positions"] == [[], [], [], [5], [7, 9]]
    assert "token_ids_logprob" not in build_score_payload(ids, token_ids=[])
    with pytest.raises(ScoringInputError, match="exclusive"):
        build_score_payload(ids, token_ids=[1], positions=[[]] * 5)
    with pytest.raises(ScoringInputError, match="one per input position"):
        build_score_payload(ids, positions=[[]] * 4)
    with pytest.raises(ScoringInputError, match=r"outside \[0, 8\)"):
        build_score_payload(ids, token_ids=[8], vocab_size=8)
    with pytest.raises(ScoringInputError, match="empty"):
        build_score_payload([])


def _reply(tokens: list[int], top_k: int, rows: list[list[int]] | None, per_position: bool) -> Any:
    prompt = len(tokens) - (len(rows) if rows else 0)
    meta = TEACHER.score(
        tokens,
        top_k=top_k,
        flat_ids=flat_token_ids(rows) if rows and not per_position else None,
        positions=per_position_ids(rows, prompt) if rows and per_position else None,
    )
    # a JSON round trip, as over the wire
    return json.loads(json.dumps({"text": "", "meta_info": meta}))


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    prompt=st.integers(1, 6),
    resp=st.integers(1, 6),
    k=st.integers(1, 4),
)
def test_flat_and_per_position_parse_to_equal_views(
    data: st.DataObject, prompt: int, resp: int, k: int
) -> None:
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=prompt + resp, max_size=prompt + resp))
    rows = data.draw(
        st.lists(
            st.lists(st.integers(0, 63), min_size=0, max_size=k, unique=True),
            min_size=resp,
            max_size=resp,
        )
    )
    if not any(rows):
        rows[0] = [0]
    views = [
        parse_score_response(
            _reply(tokens, k, rows, pp), tokens, resp, ["top", "ids"], requested=rows
        )
        for pp in (False, True)
    ]
    assert views[0] == views[1]
    lp = TEACHER.log_probs(tokens)
    assert views[0].ids is not None
    for r, want in enumerate(rows):
        assert set(views[0].ids[r]) == set(want)
        for t in want:
            assert views[0].ids[r][t] == float(lp[prompt + r - 1, t])
        assert views[0].token_logprobs[r] == float(lp[prompt + r - 1, tokens[prompt + r]])
    assert views[0].top is not None
    assert all(len(m) == k for m in views[0].top)


TOKENS = [3, 1, 4, 1, 5, 9, 2]
ROWS = [[6], [5, 3], [], [8]]
R = len(ROWS)


def _good(per_position: bool = True) -> Any:
    return _reply(TOKENS, 2, ROWS, per_position)


def _parse(obj: Any) -> Any:
    return parse_score_response(
        obj, TOKENS, R, ["top", "ids"], requested=ROWS, url="http://t:1", sample_index=4
    )


def _mutate(fn: Any, per_position: bool = True) -> Any:
    obj = copy.deepcopy(_good(per_position))
    fn(obj)
    return obj


MALFORMED = {
    "not an object": (lambda o: o.clear(), "no meta_info"),
    "meta_info missing": (lambda o: o.pop("meta_info"), "no meta_info"),
    "meta_info not a dict": (lambda o: o.update(meta_info=[1]), "meta_info is list"),
    "token field missing": (
        lambda o: o["meta_info"].pop("input_token_logprobs"),
        "no 'input_token_logprobs'",
    ),
    "top field missing": (
        lambda o: o["meta_info"].pop("input_top_logprobs"),
        "no 'input_top_logprobs'",
    ),
    "ids wrong length": (
        lambda o: o["meta_info"]["input_token_ids_logprobs"].pop(),
        "has 6 rows, expected 7",
    ),
    "token logprob null": (
        lambda o: o["meta_info"]["input_token_logprobs"][-1].__setitem__(0, None),
        "expected a logprob",
    ),
    "token logprob nan": (
        lambda o: o["meta_info"]["input_token_logprobs"][-2].__setitem__(0, math.nan),
        "non-finite",
    ),
    "top row null in span": (
        lambda o: o["meta_info"]["input_top_logprobs"].__setitem__(-1, None),
        "expected a list",
    ),
    "top value inf": (
        lambda o: o["meta_info"]["input_top_logprobs"][-1][0].__setitem__(0, -math.inf),
        "non-finite",
    ),
    "requested row null": (
        lambda o: o["meta_info"]["input_token_ids_logprobs"].__setitem__(4, None),
        "is null but ids",
    ),
    "requested id absent": (
        lambda o: o["meta_info"]["input_token_ids_logprobs"][6].pop(),
        "lacks requested token id",
    ),
    "entry too short": (
        lambda o: o["meta_info"]["input_token_ids_logprobs"][4].__setitem__(0, [0.5]),
        "expected \\[logprob, id",
    ),
    "echo drift": (
        lambda o: o["meta_info"]["input_token_logprobs"][2].__setitem__(1, 99),
        "echoes token id 99 but input_ids\\[2\\] is 4",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_replies_raise_named_errors(case: str) -> None:
    fn, message = MALFORMED[case]
    obj = _mutate(fn)
    with pytest.raises(TeacherResponseError, match=message) as info:
        _parse(obj)
    assert info.value.url == "http://t:1"
    assert info.value.sample_index == 4
    assert "http://t:1" in str(info.value)
    assert "sample 4" in str(info.value)


def test_non_object_reply_and_tolerated_shapes() -> None:
    with pytest.raises(TeacherResponseError, match="expected a JSON object"):
        _parse([1, 2])
    # an empty requested row may come back as null or []; extra keys are ignored
    obj = _good()
    obj["meta_info"]["input_token_ids_logprobs"][5] = []
    obj["meta_info"]["unknown"] = 1
    obj["extra"] = {"x": 1}
    view = _parse(obj)
    assert view.ids is not None
    assert view.ids[2] == {}
    flat_view = _parse(_good(per_position=False))
    assert flat_view == view


def test_response_len_needs_a_prompt() -> None:
    with pytest.raises(ScoringInputError, match="R <= L - 1"):
        parse_score_response(_good(), TOKENS, len(TOKENS), [])


def test_summary_is_compact() -> None:
    obj = _good(per_position=False)
    obj["text"] = "x" * 2000
    obj["meta_info"].update(weight_version="v3", prompt_tokens=len(TOKENS))
    s = summarize_response(obj)
    assert s["text"] == "x" * 512
    assert s["text_len"] == 2000
    assert s["weight_version"] == "v3"
    assert s["prompt_tokens"] == len(TOKENS)
    assert s["lists"]["input_token_ids_logprobs"] == {"type": "list", "len": len(TOKENS)}
    assert s["keys"] == ["meta_info", "text"]
    assert len(json.dumps(s)) < 1500
    assert summarize_response([1]) == {"type": "list"}
