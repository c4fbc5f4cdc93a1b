"""Reverse-KL signals: fixed examples per strategy, properties, stop-gradient, CP slicing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.opd import (
    MissingLogprobError,
    ScoringInputError,
    Strategy,
    StudentTopLogprobsError,
    WeightMode,
    apply_opd,
    cp_response_index,
    sampled_reverse_kl,
    select_ids,
    slice_response_for_cp,
    topk_reverse_kl,
)

L = math.log

# Two response positions. S: student top, T: teacher top, TS: teacher on student ids,
# ST: student on teacher ids; values are log-probabilities of round numbers.
S = [{1: L(0.5), 2: L(0.3)}, {4: L(0.6), 5: L(0.2)}]
T = [{1: L(0.4), 3: L(0.35)}, {5: L(0.5), 6: L(0.3)}]
TS = [{1: L(0.4), 2: L(0.1)}, {4: L(0.1), 5: L(0.5)}]
ST = [{1: L(0.5), 3: L(0.05)}, {5: L(0.2), 6: L(0.1)}]


def _allclose(x: torch.Tensor | None, y: torch.Tensor) -> None:
    # torch.allclose, not torch.testing.assert_close: the latter's first call imports ~5 s
    # of machinery, a tenth of this package's test budget.
    assert x is not None
    assert x.dtype == y.dtype, (x.dtype, y.dtype)
    assert x.shape == y.shape, (x.shape, y.shape)
    assert torch.allclose(x, y, rtol=1.3e-6, atol=1e-5), (x, y)


def _close(x: torch.Tensor, expected: list[float]) -> None:
    assert x.dtype == torch.float32
    assert not x.requires_grad
    _allclose(x, torch.tensor(expected, dtype=torch.float32))


def test_only_student_student_p_is_weighted_log_ratio() -> None:
    # sum over student ids of renormalised p_s * log(p_s / p_t)
    e0 = (0.5 / 0.8) * L(0.5 / 0.4) + (0.3 / 0.8) * L(0.3 / 0.1)
    e1 = (0.6 / 0.8) * L(0.6 / 0.1) + (0.2 / 0.8) * L(0.2 / 0.5)
    _close(topk_reverse_kl(S, None, TS, None, "only-student", "student_p"), [e0, e1])


def test_intersection_none_is_log_ratio_of_single_overlap() -> None:
    _close(topk_reverse_kl(S, T, None, None, "intersection", "none"), [L(0.5 / 0.4), L(0.2 / 0.5)])


def test_only_teacher_needs_no_student_top_and_renormalises_teacher_weights() -> None:
    e0 = (0.4 / 0.75) * L(0.5 / 0.4) + (0.35 / 0.75) * L(0.05 / 0.35)
    e1 = (0.5 / 0.8) * L(0.2 / 0.5) + (0.3 / 0.8) * L(0.1 / 0.3)
    _close(
        topk_reverse_kl(None, T, None, ST, Strategy.ONLY_TEACHER, WeightMode.TEACHER_P), [e0, e1]
    )


def test_xor_none_is_unweighted_sum_over_symmetric_difference() -> None:
    e0 = L(0.3 / 0.1) + L(0.05 / 0.35)  # {2} from S, {3} from T
    e1 = L(0.6 / 0.1) + L(0.1 / 0.3)  # {4} from S, {6} from T
    _close(topk_reverse_kl(S, T, TS, ST, "xor", "none"), [e0, e1])


def test_xor_student_p_uses_unnormalised_probabilities() -> None:
    e0 = 0.3 * L(0.3 / 0.1) + 0.05 * L(0.05 / 0.35)
    _close(topk_reverse_kl(S[:1], T[:1], TS[:1], ST[:1], "xor", "student_p"), [e0])


def test_union_student_p_weights_all_ids() -> None:
    w = [0.5 / 0.85, 0.3 / 0.85, 0.05 / 0.85]
    r = [L(0.5 / 0.4), L(0.3 / 0.1), L(0.05 / 0.35)]
    e0 = sum(a * b for a, b in zip(w, r, strict=True))
    _close(topk_reverse_kl(S[:1], T[:1], TS[:1], ST[:1], "union", "student_p"), [e0])


def test_selection_order_per_strategy() -> None:
    s, t = {1: 0.0, 2: 0.0, 7: 0.0}, {3: 0.0, 1: 0.0}
    assert select_ids(s, t, Strategy.ONLY_STUDENT) == [1, 2, 7]
    assert select_ids(s, t, Strategy.ONLY_TEACHER) == [3, 1]
    assert select_ids(s, t, Strategy.INTERSECTION) == [1]
    assert select_ids(s, t, Strategy.UNION) == [1, 2, 7, 3]
    assert select_ids(s, t, Strategy.XOR) == [2, 7, 3]


def test_missing_logprob_names_side_and_id() -> None:
    with pytest.raises(MissingLogprobError, match="Missing teacher logprob for token id 2"):
        topk_reverse_kl(S[:1], None, [{1: L(0.4)}], None, "only-student")
    with pytest.raises(MissingLogprobError, match="Missing student logprob for token id 3"):
        topk_reverse_kl(None, T[:1], None, [{1: L(0.5)}], "only-teacher")


def test_row_count_mismatch_and_missing_student_top_raise() -> None:
    with pytest.raises(ScoringInputError, match="disagree in length"):
        topk_reverse_kl(S, None, TS[:1], None, "only-student")
    with pytest.raises(StudentTopLogprobsError):
        topk_reverse_kl(None, T, TS, ST, "union")


def test_empty_sets_give_zero_and_empty_response_gives_empty_tensor() -> None:
    out = topk_reverse_kl([{}, {1: 0.0}], [{2: 0.0}, {3: 0.0}], None, None, "intersection")
    _close(out, [0.0, 0.0])
    assert topk_reverse_kl([], None, [], None, "only-student").shape == (0,)


_logprob = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)
_row = st.dictionaries(st.integers(0, 50), _logprob, min_size=1, max_size=6)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(_row, min_size=0, max_size=5),
    strategy=st.sampled_from(list(Strategy)),
    mode=st.sampled_from(list(WeightMode)),
)
def test_reverse_kl_is_zero_when_teacher_equals_student(
    rows: list[dict[int, float]], strategy: Strategy, mode: WeightMode
) -> None:
    # Same model on both sides: every map is the same, so every log-ratio is 0.
    out = topk_reverse_kl(rows, rows, rows, rows, strategy, mode)
    assert out.shape == (len(rows),)
    assert torch.count_nonzero(out) == 0
    tl = torch.tensor([next(iter(r.values())) for r in rows], dtype=torch.float32)
    assert torch.count_nonzero(sampled_reverse_kl(tl, tl)) == 0


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.lists(
        st.dictionaries(st.integers(0, 30), st.tuples(_logprob, _logprob), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    )
)
def test_none_weights_with_intersection_give_mean_log_ratio(
    pairs: list[dict[int, tuple[float, float]]],
) -> None:
    s = [{k: a for k, (a, _) in p.items()} for p in pairs]
    t = [{k: b for k, (_, b) in p.items()} for p in pairs]
    out = topk_reverse_kl(s, t, None, None, "intersection", "none")
    expected = [math.fsum(a - b for a, b in p.values()) / len(p) for p in pairs]
    _allclose(out, torch.tensor(expected, dtype=torch.float32))


def test_stop_gradient_advantages_carry_no_graph_and_grad_is_advantage() -> None:
    torch.manual_seed(0)
    r = 6
    base = torch.randn(r, requires_grad=True)  # a graph behind the stored log-probs
    old_src = torch.randn(r, requires_grad=True)
    teacher_src = torch.randn(r, requires_grad=True)
    old_logp = old_src * 1.5  # has a graph
    teacher_logp = teacher_src - 0.1  # has a graph
    adv_in = base * 2.0  # advantages computed with a graph by mistake
    new_adv, rkl = apply_opd([adv_in], coef=0.7, old_logp=[old_logp], teacher_logp=[teacher_logp])
    assert not new_adv[0].requires_grad
    assert new_adv[0].grad_fn is None
    assert not rkl[0].requires_grad
    assert rkl[0].grad_fn is None
    _allclose(rkl[0], (old_logp - teacher_logp).detach())
    _allclose(new_adv[0], (adv_in - 0.7 * (old_logp - teacher_logp)).detach())
    logp_new = torch.randn(r, requires_grad=True)
    (new_adv[0] * logp_new).sum().backward()
    _allclose(logp_new.grad, new_adv[0])
    assert base.grad is None
    assert old_src.grad is None
    assert teacher_src.grad is None


def test_apply_opd_precomputed_wins_never_in_place_and_names_sample() -> None:
    adv = [torch.ones(3), torch.zeros(2)]
    before = [a.clone() for a in adv]
    pre = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5])]
    out, rkl = apply_opd(
        adv, coef=2.0, reverse_kl=pre, old_logp=[torch.zeros(3), torch.zeros(2)],
        teacher_logp=[torch.full((3,), 9.0), torch.full((2,), 9.0)],
    )  # fmt: skip
    _allclose(out[0], torch.tensor([-1.0, -3.0, -5.0]))
    _allclose(out[1], torch.tensor([-1.0, -1.0]))
    assert all(torch.equal(a, b) for a, b in zip(adv, before, strict=True))
    assert rkl[0] is not pre[0]
    with pytest.raises(ScoringInputError, match="sample 1"):
        apply_opd(adv, coef=1.0, reverse_kl=[torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ScoringInputError, match="sample 0"):
        apply_opd(adv[:1], coef=1.0)


def test_pure_opd_advantage_is_minus_coef_times_rkl() -> None:
    rkl = torch.tensor([0.25, -0.5])
    out, _ = apply_opd([torch.zeros(2)], coef=1.0, reverse_kl=[rkl])
    _allclose(out[0], -rkl)


@pytest.mark.parametrize(
    ("fmt", "max_seq_len", "expected"),
    [("thd", None, [[6], [0, 1, 2, 3, 4, 5]]), ("bshd", 16, [[0], [1, 2, 3, 4, 5, 6]])],
)
def test_cp_slicing_vectors(fmt: str, max_seq_len: int | None, expected: list[list[int]]) -> None:
    x = torch.arange(7, dtype=torch.float32) * 10
    for rank in range(2):
        idx = cp_response_index(11, 7, rank, 2, fmt, max_seq_len)  # type: ignore[arg-type]
        assert idx.tolist() == expected[rank]
        out = slice_response_for_cp(x, 11, 7, rank, 2, fmt, max_seq_len)  # type: ignore[arg-type]
        assert out.dtype == torch.float32
        _allclose(out, x[expected[rank]])


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.integers(1, 20),
    resp=st.integers(0, 40),
    cp=st.integers(1, 4),
    pad=st.integers(0, 9),
    fmt=st.sampled_from(["thd", "bshd"]),
)
def test_cp_indices_partition_the_response(
    prompt: int, resp: int, cp: int, pad: int, fmt: str
) -> None:
    total = prompt + resp
    got = [
        cp_response_index(total, resp, r, cp, fmt, total + pad).tolist()  # type: ignore[arg-type]
        for r in range(cp)
    ]
    assert sorted(i for g in got for i in g) == list(range(resp))


def test_cp_bad_arguments_raise() -> None:
    with pytest.raises(ScoringInputError, match="resp_len=3"):
        slice_response_for_cp(torch.zeros(4), 8, 3, 0, 2)
    with pytest.raises(ScoringInputError, match="max_seq_len"):
        cp_response_index(8, 3, 0, 2, "bshd", None)
    with pytest.raises(ScoringInputError, match="cp_rank"):
        cp_response_index(8, 3, 2, 2)
