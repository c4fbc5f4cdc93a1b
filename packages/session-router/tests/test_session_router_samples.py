"""Sample assembly (trim, truncate, merge), and assembled samples through samples/1 and back.

The samples/1 format itself (strictness, corrupt bytes) is tested in ``packages/formats``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import decode_samples, encode_samples
from posttrain.interface import WEIGHT_VERSIONS_KEY, SampleStatus
from posttrain.session_router import SampleAssemblyError, TurnRecord, assemble_samples


def rec(
    prompt: list[int],
    output: list[int],
    finish: str = "stop",
    lp0: float = -0.5,
    top: list[Any] | None = None,
    weight_version: object = "3",  # SGLang's string form: assembly converts it
) -> TurnRecord:
    meta: dict[str, Any] = {"weight_version": weight_version}
    if top is not None:
        meta["output_top_logprobs"] = top
    return TurnRecord(
        timestamp=time.time(),
        request_timestamp=time.time(),
        method="POST",
        path="/generate",
        request={"input_ids": prompt},
        response={"meta_info": meta},
        status_code=200,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[lp0 - i for i in range(len(output))],
        finish_reason=finish,
    )


def conversation(
    prompt0: list[int],
    outs: list[list[int]],
    obs: list[list[int]],
    trims: list[int],
    finishes: list[str],
) -> tuple[list[TurnRecord], list[int]]:
    """Records of a conversation in which turn i's last ``trims[i]`` output tokens were replaced."""
    records, prompt = [], list(prompt0)
    for i, out in enumerate(outs):
        records.append(rec(list(prompt), out, finishes[i], lp0=-0.1 * (i + 1)))
        kept = out[: len(out) - trims[i]] if i < len(outs) - 1 else out
        prompt = prompt + kept + (obs[i] if i < len(outs) - 1 else [])
    return records, prompt


def test_three_turns_merge_with_observation_masks() -> None:
    records, acc = conversation(
        [1, 2], [[10, 11, 99], [12, 99], [13]], [[5, 6], [7]], [1, 0, 0], ["stop"] * 3
    )
    result = assemble_samples(records, acc, max_trim_tokens=1, metadata={"k": "v"})
    (s,) = result.samples
    assert s.prompt_ids == [1, 2]
    # turn 0 lost its trailing stop token 99 (replaced by the template), then obs 5,6 ...
    assert s.response_ids == [10, 11, 5, 6, 12, 99, 7, 13]
    assert s.loss_mask == [1, 1, 0, 0, 1, 1, 0, 1]
    assert s.rollout_logprobs == [-0.1, -1.1, 0.0, 0.0, -0.2, -1.2, 0.0, -0.30000000000000004]
    assert s.tokens == acc
    assert s.status is SampleStatus.COMPLETED
    assert s.weight_version == 3
    assert s.metadata[WEIGHT_VERSIONS_KEY] == [3, 3, 3]
    assert s.metadata["k"] == "v"
    assert s.metadata["num_turns"] == 3


def test_trim_limits_and_accumulated_end() -> None:
    records, acc = conversation([1], [[10, 98, 99], [12]], [[5]], [2], ["stop", "stop"])
    with pytest.raises(SampleAssemblyError, match=r"records\[0\]: 2 output tokens"):
        assemble_samples(records, acc, max_trim_tokens=1)
    records, acc = conversation([1], [[10, 99]], [], [0], ["stop"])
    with pytest.raises(SampleAssemblyError, match="accumulated"):
        assemble_samples(records, [*acc, 4], max_trim_tokens=1)
    with pytest.raises(SampleAssemblyError, match=r"records\[0\]: 1 output tokens"):
        assemble_samples(records, acc[:-1], max_trim_tokens=1)  # never trim the last turn


def test_truncation_before_merge_and_empty_reasons() -> None:
    records, acc = conversation([1, 2], [[10, 11], [12, 13, 14]], [[5]], [0, 0], ["stop", "stop"])
    # 7 tokens allowed: turn 0 (4 tokens) fits, turn 1 (8 tokens) loses one and is truncated.
    (s,) = assemble_samples(records, acc, max_trim_tokens=1, max_seq_len=7).samples
    assert s.tokens == acc[:7]
    assert s.status is SampleStatus.TRUNCATED
    assert s.loss_mask == [1, 1, 0, 1, 1]
    # 3 tokens: turn 0 keeps one output token, is truncated, and nothing after it is merged.
    (s,) = assemble_samples(records, acc, max_trim_tokens=1, max_seq_len=3).samples
    assert s.tokens == [1, 2, 10]
    assert s.status is SampleStatus.TRUNCATED
    empty = assemble_samples(records, acc, max_trim_tokens=1, max_seq_len=2)
    assert empty.samples == []
    assert empty.empty_reason == "all_truncated"
    none = assemble_samples([], [], max_trim_tokens=1)
    assert none.samples == []
    assert none.empty_reason == "no_records"


def test_merge_stops_after_a_non_completed_turn() -> None:
    records, acc = conversation(
        [1], [[10], [11], [12]], [[5], [6]], [0, 0, 0], ["stop", "length", "stop"]
    )
    (s,) = assemble_samples(records, acc, max_trim_tokens=1).samples
    assert s.response_ids == [10, 5, 11]
    assert s.status is SampleStatus.TRUNCATED
    assert s.metadata["merged_turns"] == 2


turn_lists = st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=6), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(
    prompt0=st.lists(st.integers(0, 500), min_size=1, max_size=5),
    outs=turn_lists,
    obs_len=st.integers(1, 3),
    trim=st.booleans(),
    max_seq_len=st.none() | st.integers(1, 40),
)
def test_assembly_invariants_and_wire_round_trip(
    prompt0: list[int], outs: list[list[int]], obs_len: int, trim: bool, max_seq_len: int | None
) -> None:
    n = len(outs)
    trims = [1 if trim and len(o) > 1 and i < n - 1 else 0 for i, o in enumerate(outs)]
    obs = [[600 + j for j in range(obs_len)] for _ in range(n)]
    records, acc = conversation(prompt0, outs, obs, trims, ["stop"] * n)
    result = assemble_samples(records, acc, max_trim_tokens=1, max_seq_len=max_seq_len)
    for s in result.samples:
        assert s.tokens == acc[: len(s.tokens)]
        assert len(s.loss_mask) == len(s.rollout_logprobs) == s.response_length
        assert all(
            lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m == 0
        )
        if max_seq_len is not None:
            assert len(s.tokens) <= max_seq_len
        # Trained positions are exactly the engine's outputs, with the engine's logprobs.
        engine = {
            (len(r.prompt_ids) + j): (t, lp)
            for r in records
            for j, (t, lp) in enumerate(zip(r.output_ids, r.output_logprobs, strict=True))
        }
        for pos, m in enumerate(s.loss_mask):
            if m:
                absolute = len(s.prompt_ids) + pos
                assert engine[absolute] == (s.response_ids[pos], s.rollout_logprobs[pos])
    data = encode_samples(
        result.samples, session_metadata={"sid": "x"}, empty_reason=result.empty_reason
    )
    decoded = decode_samples(data)
    assert decoded.samples == result.samples
    assert decoded.session_metadata == {"sid": "x"}
    assert decoded.empty_reason == result.empty_reason


def _rows(out: list[int]) -> list[Any]:
    return [[[-0.25, t, None], [-1.5, t + 1, None]] for t in out]


def test_student_top_rows_follow_trim_truncation_and_merge() -> None:
    p0, out0, out1 = [1, 2], [5, 6, 7], [9, 10]  # observation token between turns: 8
    # turn 0's last output token (7) is replaced by the next prompt: it is trimmed
    recs = [rec(p0, out0, top=_rows(out0)), rec([1, 2, 5, 6, 8], out1, top=_rows(out1))]
    acc = [1, 2, 5, 6, 8, 9, 10]
    (s,) = assemble_samples(recs, acc, max_trim_tokens=1).samples
    assert s.response_ids == [5, 6, 8, 9, 10]
    assert s.metadata["opd_student_top_logprobs"] == [*_rows([5, 6]), [], *_rows([9, 10])]
    (cut,) = assemble_samples(recs, acc, max_trim_tokens=1, max_seq_len=6).samples
    assert cut.metadata["opd_student_top_logprobs"] == [*_rows([5, 6]), [], *_rows([9])]
    # null rows (SGLang's placeholder) read as empty; the wire keeps them exactly
    (one,) = assemble_samples([rec(p0, [5], top=[None])], [1, 2, 5], max_trim_tokens=1).samples
    assert one.metadata["opd_student_top_logprobs"] == [[]]
    (back,) = decode_samples(encode_samples([s])).samples
    assert back.metadata["opd_student_top_logprobs"] == s.metadata["opd_student_top_logprobs"]


def test_student_top_rows_absent_or_malformed() -> None:
    p0, out0, out1 = [1, 2], [5, 6], [9]
    acc = [1, 2, 5, 6, 8, 9]
    mixed = [rec(p0, out0, top=_rows(out0)), rec([1, 2, 5, 6, 8], out1)]
    (s,) = assemble_samples(mixed, acc, max_trim_tokens=1).samples
    assert "opd_student_top_logprobs" not in s.metadata  # never padded with empty rows
    with pytest.raises(SampleAssemblyError, match=r"records\[0\].*1 rows for 2 output tokens"):
        assemble_samples([rec(p0, out0, top=_rows([5]))], [1, 2, 5, 6], max_trim_tokens=1)


def test_engine_weight_versions_become_ints_and_bad_ones_are_refused() -> None:
    (s,) = assemble_samples([rec([1], [2], weight_version=5)], [1, 2], max_trim_tokens=0).samples
    assert s.weight_version == 5
    (s,) = assemble_samples(
        [rec([1], [2], weight_version="default")], [1, 2], max_trim_tokens=0
    ).samples
    assert s.weight_version is None
    with pytest.raises(SampleAssemblyError, match=r"meta_info\.weight_version: 'v3'"):
        assemble_samples([rec([1], [2], weight_version="v3")], [1, 2], max_trim_tokens=0)
