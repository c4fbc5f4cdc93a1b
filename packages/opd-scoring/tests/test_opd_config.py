"""Teacher URL parsing, routing, option validation, and the public surface."""

from __future__ import annotations

import inspect
import math

import pytest

import posttrain.opd as opd
from posttrain.interface import ConfigError, PosttrainError, TransportError, WireFormatError
from posttrain.opd import (
    OPDConfig,
    OPDConfigError,
    RetryPolicy,
    Strategy,
    TeacherRouter,
    TeacherRoutingError,
    Timeouts,
    WeightMode,
    parse_teacher_urls,
)


def test_all_is_exactly_the_public_surface() -> None:
    public = {
        n for n, v in vars(opd).items()
        if not n.startswith("_") and not inspect.ismodule(v)
    }  # fmt: skip
    assert set(opd.__all__) == public
    assert len(opd.__all__) == len(set(opd.__all__))


def test_error_tree_roots_in_posttrain_error() -> None:
    assert issubclass(opd.OPDError, PosttrainError)
    assert issubclass(opd.OPDConfigError, ConfigError)
    assert issubclass(opd.TeacherResponseError, WireFormatError)
    assert issubclass(opd.TeacherResponseError, ValueError)
    assert issubclass(opd.TeacherUnavailableError, TransportError)
    assert issubclass(opd.TeacherRejectedError, TransportError)
    assert issubclass(opd.StudentTopLogprobsError, opd.ScoringInputError)
    for name in opd.__all__:
        obj = getattr(opd, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, opd.OPDError), name
            assert name in (opd._errors.__doc__ or ""), f"{name} missing from the error tree"


def test_parse_teacher_urls_ok() -> None:
    got = parse_teacher_urls([" math = http://h:1/x?a=b ", "code=https://c.example/"])
    assert got == {"math": "http://h:1/x?a=b", "code": "https://c.example"}
    assert parse_teacher_urls(None) == {}
    assert parse_teacher_urls([]) == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["nourl"], "expected NAME=URL"),
        (["=http://h"], "expected NAME=URL"),
        (["a="], "expected NAME=URL"),
        (["a=http://h", "a=http://g"], "Duplicate teacher name 'a'"),
        (["a=ftp://h"], "must use http or https"),
        (["a=h:8000"], "must use http or https"),
        (["a=http://"], "has no host"),
    ],
)
def test_parse_teacher_urls_fails_fast(spec: list[str], message: str) -> None:
    with pytest.raises(OPDConfigError, match=message):
        parse_teacher_urls(spec)


def test_routing_six_cases() -> None:
    # 1. no named teachers: every sample goes to the single URL
    single = TeacherRouter(fallback_url="http://one:1")
    assert single.resolve({"opd_teacher": "x"}) == ("default", "http://one:1")
    named = {"math": "http://m:1", "code": "http://c:1"}
    with_default = TeacherRouter({**named, "default": "http://d:1"})
    no_default = TeacherRouter(named)
    # 2. known name
    assert no_default.resolve({"opd_teacher": "math"}) == ("math", "http://m:1")
    # 3./4. missing or unknown name fall back to the default entry
    assert with_default.resolve({}) == ("default", "http://d:1")
    assert with_default.resolve({"opd_teacher": "bio"}) == ("default", "http://d:1")
    # 5./6. no default: named errors
    with pytest.raises(TeacherRoutingError, match="'bio' matches no configured teacher name"):
        no_default.resolve({"opd_teacher": "bio"})
    with pytest.raises(TeacherRoutingError, match="missing teacher key 'opd_teacher'"):
        no_default.resolve({})


def test_routing_compares_as_str_and_custom_key_and_fallback() -> None:
    r = TeacherRouter({"7": "http://seven:1"}, fallback_url="http://fb:1", key="dataset")
    assert r.resolve({"dataset": 7}) == ("7", "http://seven:1")
    assert r.resolve({"dataset": 8}) == ("default", "http://fb:1")
    assert r.all_urls == ["http://seven:1", "http://fb:1"]
    with pytest.raises(OPDConfigError, match="needs teacher URLs"):
        TeacherRouter()
    with pytest.raises(OPDConfigError, match="must use http"):
        TeacherRouter(fallback_url="file:///x")


def test_config_validation() -> None:
    cfg = OPDConfig(top_k=4, strategy="union", weight_mode="none")  # type: ignore[arg-type]
    assert cfg.strategy is Strategy.UNION
    assert cfg.weight_mode is WeightMode.NONE
    assert cfg.needs_teacher_top
    assert cfg.needs_student_top
    assert cfg.needs_teacher_on_student
    assert cfg.needs_student_on_teacher
    only_t = OPDConfig(top_k=4, strategy=Strategy.ONLY_TEACHER)
    assert not only_t.needs_student_top
    assert only_t.needs_student_on_teacher
    sampled = OPDConfig()
    assert not (sampled.needs_teacher_top)
    assert not (sampled.needs_student_top)
    with pytest.raises(OPDConfigError, match="strategy='best'"):
        OPDConfig(strategy="best")  # type: ignore[arg-type]
    with pytest.raises(OPDConfigError, match="weight_mode"):
        OPDConfig(weight_mode="p")  # type: ignore[arg-type]
    with pytest.raises(OPDConfigError, match="top_k"):
        OPDConfig(top_k=-1)
    with pytest.raises(OPDConfigError, match="kl_coef"):
        OPDConfig(kl_coef=math.nan)
    with pytest.raises(OPDConfigError, match="vocab_size"):
        OPDConfig(vocab_size=0)


def test_timeouts_finite_unless_infinity_is_explicit() -> None:
    t = Timeouts()
    # RL-rollout defaults (issue #18): a hung teacher costs a sample two minutes, not 15
    assert (t.connect, t.read, t.deadline) == (10.0, 60.0, 120.0)
    assert Timeouts(read=math.inf).read == math.inf
    with pytest.raises(OPDConfigError, match=r"math\.inf"):
        Timeouts(read=None)  # type: ignore[arg-type]
    with pytest.raises(OPDConfigError, match="> 0"):
        Timeouts(deadline=0)
    with pytest.raises(OPDConfigError, match="> 0"):
        Timeouts(connect=math.nan)


def test_retry_policy_backoff_caps() -> None:
    p = RetryPolicy()
    assert p.attempts == 5
    assert [p.backoff_cap(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert p.statuses == frozenset({429, 500, 502, 503, 504})
    with pytest.raises(OPDConfigError, match="attempts"):
        RetryPolicy(attempts=0)
