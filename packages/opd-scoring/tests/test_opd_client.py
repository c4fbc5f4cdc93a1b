"""TeacherScoringClient against a real loopback teacher on 127.0.0.1 (SGLang ``/generate`` shape)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.interface import Sample, TeacherScorer, TeacherScores
from posttrain.interface.testing import free_port
from posttrain.opd import (
    CapabilityError,
    OPDConfig,
    OPDConfigError,
    OPDSignals,
    RetryPolicy,
    ScoringInputError,
    ScoringSample,
    Strategy,
    StudentTopLogprobsError,
    TeacherRejectedError,
    TeacherResponseError,
    TeacherRouter,
    TeacherRoutingError,
    TeacherScoringClient,
    TeacherUnavailableError,
    Timeouts,
    summarize_batch,
    topk_reverse_kl,
)
from posttrain.opd.testing import LoopbackTeacher, TinyTeacher

VOCAB = 256
FAST_RETRY = RetryPolicy(attempts=5, base_s=0.01, max_backoff_s=0.05)
STUDENT = TinyTeacher(VOCAB, seed=11)  # served at /student


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackTeacher]:
    with LoopbackTeacher(vocab_size=VOCAB, seed=0, names=("a", "b")) as srv:
        srv.state.teachers["student"] = STUDENT
        yield srv


@pytest.fixture
def teacher(server: LoopbackTeacher) -> LoopbackTeacher:
    st_ = server.state
    for _ in range(200):  # let handlers orphaned by earlier deadline tests finish (bounded)
        if st_.total_inflight == 0:
            break
        time.sleep(0.05)
    st_.faults.clear()
    st_.delay_s = 0.0
    st_.per_position = True
    st_.reset_counters()
    return server


def _top_rows(
    model: TinyTeacher, tokens: Sequence[int], resp: int, k: int
) -> list[dict[int, float]]:
    lp = model.log_probs(tokens)
    prompt = len(tokens) - resp
    rows = []
    for r in range(resp):
        v, i = lp[prompt + r - 1].topk(k)
        rows.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
    return rows


def _sample(
    rng: random.Random, prompt: int, resp: int, k: int, *, model: TinyTeacher = STUDENT, **meta: Any
) -> ScoringSample:
    tokens = [rng.randrange(VOCAB) for _ in range(prompt + resp)]
    top = _top_rows(model, tokens, resp, k) if k else None
    return ScoringSample(tokens=tokens, response_length=resp, metadata=meta, student_top=top)


def _scorer(srv: LoopbackTeacher, cfg: OPDConfig, **kw: Any) -> TeacherScoringClient:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeouts", Timeouts(connect=5, read=20, deadline=30))
    return TeacherScoringClient(
        kw.pop("router", TeacherRouter(fallback_url=srv.url)),
        cfg,
        student_url=kw.pop("student_url", srv.url_for("student")),
        **kw,
    )


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- values --------------------------------------------------------------------------------------


def test_signals_equal_an_in_process_computation(teacher: LoopbackTeacher) -> None:
    rng = random.Random(1)
    sample = _sample(rng, 5, 6, 3)
    cfg = OPDConfig(top_k=3, strategy=Strategy.UNION, per_position=True)

    async def go() -> OPDSignals:
        async with _scorer(teacher, cfg) as s:
            return await s.score(sample)

    out = _run(go())
    tokens, resp = list(sample.tokens), sample.response_length
    tlp = TinyTeacher(VOCAB, seed=0).log_probs(tokens)
    slp = STUDENT.log_probs(tokens)
    prompt = len(tokens) - resp
    t_top = _top_rows(TinyTeacher(VOCAB, seed=0), tokens, resp, 3)
    assert sample.student_top is not None
    ts = [{v: float(tlp[prompt + r - 1, v]) for v in sample.student_top[r]} for r in range(resp)]
    stt = [{v: float(slp[prompt + r - 1, v]) for v in t_top[r]} for r in range(resp)]
    expected = topk_reverse_kl(sample.student_top, t_top, ts, stt, "union", "student_p")
    assert out.reverse_kl is not None
    assert torch.equal(out.reverse_kl, expected)
    sampled = [float(tlp[prompt + r - 1, tokens[prompt + r]]) for r in range(resp)]
    assert out.sampled_logprobs == tuple(sampled)
    assert out.teacher_log_probs is not None
    assert out.teacher_log_probs.dtype == torch.float32
    assert len(out.positions) == resp
    assert out.positions[0].as_dict().keys() >= t_top[0].keys()
    assert out.stats.requests == 2
    assert out.stats.attempts == 2


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 10_000),
    prompt=st.integers(1, 6),
    resp=st.integers(1, 8),
    k=st.integers(1, 4),
    strategy=st.sampled_from(list(Strategy)),
)
def test_flat_equals_per_position_on_the_loopback_teacher(
    teacher: LoopbackTeacher, seed: int, prompt: int, resp: int, k: int, strategy: Strategy
) -> None:
    rng = random.Random(seed)
    samples = [_sample(rng, prompt, resp, k) for _ in range(2)]
    cfg = OPDConfig(top_k=k, strategy=strategy)

    async def go() -> Any:
        async with _scorer(teacher, cfg) as s:
            return await s.equivalence_check(samples, atol=0.0)

    rep = _run(go())
    assert rep.ok
    assert rep.max_abs_diff == 0.0
    assert rep.samples == 2
    assert rep.per_position_response_bytes <= rep.flat_response_bytes


@pytest.mark.parametrize("strategy", list(Strategy))
def test_reverse_kl_is_zero_when_teacher_is_the_student(
    teacher: LoopbackTeacher, strategy: Strategy
) -> None:
    rng = random.Random(2)
    model = teacher.state.teachers["a"]
    samples = [_sample(rng, 3, 5, 4, model=model) for _ in range(3)]
    cfg = OPDConfig(top_k=4, strategy=strategy, per_position=True)

    async def go() -> list[OPDSignals]:
        async with _scorer(teacher, cfg, router=TeacherRouter(fallback_url=teacher.url_for("a")),
                           student_url=teacher.url_for("a")) as s:  # fmt: skip
            return await s.score_batch(samples)

    for out in _run(go()):
        assert out.reverse_kl is not None
        assert torch.count_nonzero(out.reverse_kl) == 0


def test_interface_samples_route_by_metadata(teacher: LoopbackTeacher) -> None:
    rng = random.Random(3)
    router = TeacherRouter({"a": teacher.url_for("a"), "b": teacher.url_for("b")})
    samples = []
    for j in range(4):
        tokens = [rng.randrange(VOCAB) for _ in range(7)]
        rows = _top_rows(STUDENT, tokens, 3, 2)
        sglang_rows = [[[lp, tid, None] for tid, lp in row.items()] for row in rows]
        samples.append(
            Sample(
                prompt_ids=tokens[:4], response_ids=tokens[4:], rollout_logprobs=[0.0] * 3,
                loss_mask=[1] * 3,
                metadata={"opd_teacher": "ab"[j % 2], "opd_student_top_logprobs": sglang_rows},
            )
        )  # fmt: skip

    async def go() -> list[OPDSignals]:
        async with _scorer(teacher, OPDConfig(top_k=2), router=router) as s:
            # The client is the interface's TeacherScorer: a GRPO loop holds it as one.
            assert isinstance(s, TeacherScorer)
            scorer: TeacherScorer = s
            return list(await scorer.score_batch(samples))

    outs = _run(go())
    assert all(isinstance(o, TeacherScores) for o in outs)
    assert [o.teacher_name for o in outs] == ["a", "b", "a", "b"]
    for smp, o in zip(samples, outs, strict=True):
        lp = teacher.state.teachers[o.teacher_name].log_probs(smp.tokens)
        want = tuple(float(lp[3 + r, smp.response_ids[r]]) for r in range(3))
        assert o.sampled_logprobs == want
    assert teacher.state.requests["a"] == 2
    assert teacher.state.requests["b"] == 2
    summary = summarize_batch(outs)
    assert summary["teachers"] == {"a": 2, "b": 2}
    assert summary["retried_samples"] == 0
    assert summary["reverse_kl"]["tokens"] == 12


def test_sampled_mode_returns_teacher_logprobs_only(teacher: LoopbackTeacher) -> None:
    rng = random.Random(4)
    samples = [_sample(rng, 2, r, 0) for r in (0, 1, 5)]

    async def go() -> list[OPDSignals]:
        async with _scorer(teacher, OPDConfig()) as s:
            return await s.score_batch(samples)

    outs = _run(go())
    assert [len(o.sampled_logprobs or ()) for o in outs] == [0, 1, 5]  # input order
    assert all(o.reverse_kl is None and o.positions == () for o in outs)
    body = teacher.state.bodies[-1]
    assert "top_logprobs_num" not in body
    assert "token_ids_logprob" not in body


def test_bad_samples_fail_fast_or_land_in_their_slot(teacher: LoopbackTeacher) -> None:
    rng = random.Random(5)
    router = TeacherRouter({"a": teacher.url_for("a")})
    good = [_sample(rng, 2, 3, 2, opd_teacher="a") for _ in range(3)]
    bad_route = _sample(rng, 2, 3, 2, opd_teacher="zzz")
    short_top = ScoringSample(tokens=good[0].tokens, response_length=3, student_top=[{1: -1.0}],
                              metadata={"opd_teacher": "a"})  # fmt: skip
    cfg = OPDConfig(top_k=2)

    async def go(samples: list[ScoringSample], rex: bool) -> Any:
        async with _scorer(teacher, cfg, router=router) as s:
            if rex:
                return await s.score_batch(samples, return_exceptions=True)
            return await s.score_batch(samples)

    with pytest.raises(TeacherRoutingError, match="'zzz' matches no"):
        _run(go([good[0], bad_route, good[1]], False))
    with pytest.raises(StudentTopLogprobsError, match="sample 1: student top-k rows are 1"):
        _run(go([good[0], short_top], False))
    outs = _run(go([good[0], bad_route, good[2]], True))
    assert isinstance(outs[0], OPDSignals)
    assert isinstance(outs[2], OPDSignals)
    assert isinstance(outs[1], TeacherRoutingError)


def test_strategies_needing_the_student_require_its_url(teacher: LoopbackTeacher) -> None:
    with pytest.raises(OPDConfigError, match="student_url is required"):
        TeacherScoringClient(
            TeacherRouter(fallback_url=teacher.url), OPDConfig(top_k=2, strategy="xor")
        )  # type: ignore[arg-type]


# -- transport -----------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_retryable_statuses_are_retried(teacher: LoopbackTeacher, status: int) -> None:
    teacher.state.faults.extend([f"status:{status}", f"status:{status}"])
    sample = _sample(random.Random(6), 3, 2, 0)

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig()) as s:
            return await s.score(sample)

    out = _run(go())
    assert out.stats.attempts == 3
    assert out.stats.requests == 1
    assert teacher.state.requests[""] == 3


@pytest.mark.parametrize("status", [400, 404, 422])
def test_other_4xx_are_not_retried(teacher: LoopbackTeacher, status: int) -> None:
    teacher.state.faults.append(f"status:{status}")
    sample = _sample(random.Random(7), 3, 2, 0)

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig()) as s:
            return await s.score(sample, index=9)

    with pytest.raises(TeacherRejectedError, match=f"answered {status} for sample 9") as info:
        _run(go())
    assert info.value.status == status
    assert info.value.url == teacher.url
    assert teacher.state.requests[""] == 1


def test_retries_run_out(teacher: LoopbackTeacher) -> None:
    teacher.state.faults.extend(["status:503"] * 5)

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig()) as s:
            return await s.score(_sample(random.Random(8), 3, 2, 0))

    with pytest.raises(TeacherUnavailableError, match="after 5 attempts") as info:
        _run(go())
    assert info.value.attempts == 5
    assert info.value.status == 503
    assert teacher.state.requests[""] == 5


def test_connection_errors_are_retried_then_reported() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go() -> OPDSignals:
        async with TeacherScoringClient(
            TeacherRouter(fallback_url=url), OPDConfig(),
            retry=RetryPolicy(attempts=3, base_s=0.01, max_backoff_s=0.02),
        ) as s:  # fmt: skip
            return await s.score(_sample(random.Random(9), 3, 2, 0))

    with pytest.raises(TeacherUnavailableError) as info:
        _run(go())
    assert info.value.attempts == 3
    assert isinstance(info.value.cause, httpx.ConnectError)
    assert info.value.url == url


def test_deadline_cuts_a_hanging_request_short(teacher: LoopbackTeacher) -> None:
    teacher.state.faults.append("delay:2")

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig(), timeouts=Timeouts(deadline=0.3)) as s:
            return await s.score(_sample(random.Random(10), 3, 2, 0))

    with pytest.raises(TeacherUnavailableError, match=r"deadline of 0\.3s") as info:
        _run(go())
    assert info.value.attempts == 1
    assert info.value.elapsed_s < 2


def test_read_timeout_is_retried_within_the_deadline(teacher: LoopbackTeacher) -> None:
    teacher.state.faults.append("delay:1")

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig(), timeouts=Timeouts(read=0.2, deadline=10)) as s:
            return await s.score(_sample(random.Random(11), 3, 2, 0))

    assert _run(go()).stats.attempts == 2


@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(per_url=st.integers(1, 5), total=st.integers(1, 7))
def test_in_flight_never_exceeds_the_bounds(
    teacher: LoopbackTeacher, per_url: int, total: int
) -> None:
    teacher.state.reset_counters()
    teacher.state.delay_s = 0.03
    rng = random.Random(per_url * 10 + total)
    router = TeacherRouter({"a": teacher.url_for("a"), "b": teacher.url_for("b")})
    samples = [_sample(rng, 2, 2, 0, opd_teacher="ab"[j % 2]) for j in range(16)]

    async def go() -> list[OPDSignals]:
        async with _scorer(teacher, OPDConfig(), router=router, per_url_concurrency=per_url,
                           max_concurrency=total, connections_per_client=2) as s:  # fmt: skip
            return await s.score_batch(samples)

    assert len(_run(go())) == 16
    st_ = teacher.state
    assert 1 <= st_.max_inflight["a"] <= per_url
    assert 1 <= st_.max_inflight["b"] <= per_url
    assert st_.max_total_inflight <= total
    assert st_.requests["a"] == 8
    assert st_.requests["b"] == 8


def test_requests_spread_over_shard_clients(teacher: LoopbackTeacher) -> None:
    teacher.state.delay_s = 0.3
    rng = random.Random(12)
    samples = [_sample(rng, 2, 2, 0) for _ in range(16)]

    async def go() -> None:
        async with _scorer(teacher, OPDConfig(), per_url_concurrency=16,
                           connections_per_client=4) as s:  # fmt: skip
            await s.score_batch(samples)

    _run(go())
    # one client holds at most 4 connections; 16 concurrent requests used 4 clients
    assert len(teacher.state.peers) > 4
    assert teacher.state.max_total_inflight <= 16


MALFORMED = {
    "truncate": "not valid JSON",
    "drop_meta": "no meta_info",
    "meta_not_dict": "meta_info is list",
    "short:input_token_logprobs": "expected 5",
    "null:input_token_logprobs": "expected a logprob",
    "nan:input_token_logprobs": "non-finite",
    "drift": "tokenizer or offset drift",
    "drop:input_token_ids_logprobs": "no 'input_token_ids_logprobs'",
    "null:input_token_ids_logprobs": "expected a logprob",
}


@pytest.mark.parametrize("fault", sorted(MALFORMED))
def test_malformed_replies_raise_named_errors_and_are_not_retried(
    teacher: LoopbackTeacher, fault: str
) -> None:
    teacher.state.faults.append(fault)
    sample = _sample(random.Random(13), 2, 3, 2)

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig(top_k=2, per_position=True)) as s:
            return await s.score(sample, index=3)

    with pytest.raises(TeacherResponseError, match=MALFORMED[fault]) as info:
        _run(go())
    assert info.value.url == teacher.url
    assert info.value.sample_index == 3
    assert teacher.state.requests[""] == 1


def test_injected_transport_reaches_every_shard() -> None:
    model = TinyTeacher(VOCAB, seed=0)
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        req = json.loads(request.content)
        meta = model.score(req["input_ids"])
        return httpx.Response(200, json={"text": "", "meta_info": meta})

    sample = _sample(random.Random(14), 3, 4, 0)

    async def go() -> list[OPDSignals]:
        async with TeacherScoringClient(
            TeacherRouter(fallback_url="http://teacher.invalid:30000"), OPDConfig(),
            transport=httpx.MockTransport(handle), timeouts=Timeouts(read=math.inf),
        ) as s:  # fmt: skip
            return await s.score_batch([sample] * 3)

    outs = _run(go())
    assert seen == ["http://teacher.invalid:30000/generate"] * 3
    assert outs[0].sampled_logprobs == outs[2].sampled_logprobs


# -- capability checks ---------------------------------------------------------------------------


def test_probe_checks_per_position_support(teacher: LoopbackTeacher) -> None:
    async def go(per_position: bool) -> dict[str, float]:
        async with _scorer(teacher, OPDConfig(top_k=2, per_position=per_position,
                                              strategy=Strategy.UNION)) as s:  # fmt: skip
            return await s.probe()

    assert set(_run(go(True))) == {teacher.url, teacher.url_for("student")}
    teacher.state.per_position = False  # an unpatched server ignores the key
    with pytest.raises(CapabilityError, match="ignored token_ids_logprob_positions"):
        _run(go(True))
    assert set(_run(go(False))) == {teacher.url, teacher.url_for("student")}


def test_probe_reports_unreachable_teacher() -> None:
    url = f"http://127.0.0.1:{free_port()}"

    async def go() -> dict[str, float]:
        async with TeacherScoringClient(TeacherRouter(fallback_url=url), OPDConfig(),
                                 retry=RetryPolicy(attempts=1)) as s:  # fmt: skip
            return await s.probe()

    with pytest.raises(TeacherUnavailableError, match="attempts=1"):
        _run(go())


def test_equivalence_check_flags_a_drifting_server(teacher: LoopbackTeacher) -> None:
    # The per-position pass hits a server whose per-position rows come from another model.
    rng = random.Random(15)
    samples = [_sample(rng, 3, 4, 2) for _ in range(2)]
    original = teacher.state.teachers[""]

    async def go() -> Any:
        async with _scorer(teacher, OPDConfig(top_k=2)) as s:
            flat_only = await s.equivalence_check(samples)
            teacher.state.teachers[""] = _PerPositionSkew(original)
            try:
                skewed = await s.equivalence_check(samples)
            finally:
                teacher.state.teachers[""] = original
            return flat_only, skewed

    ok, skewed = _run(go())
    assert ok.ok
    assert ok.max_abs_diff == 0.0
    assert not skewed.ok
    assert skewed.mismatched == [0, 1]
    assert skewed.max_abs_diff > 0


class _PerPositionSkew(TinyTeacher):
    """Answers per-position requests from a shifted model (a server bug to catch)."""

    def __init__(self, base: TinyTeacher) -> None:
        self.__dict__.update(base.__dict__)
        self._other = TinyTeacher(base.vocab_size, seed=99)

    def score(self, input_ids: Sequence[int], **kw: Any) -> dict[str, Any]:
        if kw.get("positions") is not None:
            meta = self._other.score(input_ids, **kw)
            meta["input_token_logprobs"] = super().score(input_ids)["input_token_logprobs"]
            return meta
        return super().score(input_ids, **kw)


class _CancelRecorder(httpx.AsyncHTTPTransport):
    """Real loopback transport that counts requests cancelled while on the wire."""

    cancelled = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except asyncio.CancelledError:
            type(self).cancelled += 1
            raise


def test_fail_fast_cancels_requests_in_flight(teacher: LoopbackTeacher) -> None:
    teacher.state.delay_s = 1.5
    rng = random.Random(16)
    router = TeacherRouter({"a": teacher.url_for("a")})
    slow = [_sample(rng, 2, 2, 0, opd_teacher="a") for _ in range(2)]
    bad = _sample(rng, 2, 2, 0, opd_teacher="nope")
    _CancelRecorder.cancelled = 0

    async def go() -> list[OPDSignals]:
        async with _scorer(teacher, OPDConfig(), router=router,
                           transport=_CancelRecorder()) as s:  # fmt: skip
            return await s.score_batch([slow[0], slow[1], bad])

    with pytest.raises(TeacherRoutingError):
        _run(go())
    assert _CancelRecorder.cancelled == 2


def test_ids_outside_the_vocabulary_are_refused_before_sending(teacher: LoopbackTeacher) -> None:
    sample = ScoringSample(
        tokens=[1, 2, 3, 4], response_length=2, student_top=[{5: -1.0}, {VOCAB: -2.0}]
    )

    async def go() -> OPDSignals:
        async with _scorer(teacher, OPDConfig(top_k=1, vocab_size=VOCAB)) as s:
            return await s.score(sample)

    with pytest.raises(ScoringInputError, match=rf"token id {VOCAB} is outside \[0, {VOCAB}\)"):
        _run(go())
    assert teacher.state.requests[""] == 0


def test_scorer_satisfies_the_interface_protocol(teacher: LoopbackTeacher) -> None:
    assert isinstance(_scorer(teacher, OPDConfig()), TeacherScorer)
