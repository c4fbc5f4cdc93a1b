"""OPD options, transport limits, and teacher routing (validated at construction: fail fast).

Departures from miles: a teacher URL must be http(s) with a host (miles takes any
non-empty string and fails at the first request); every timeout is finite unless
``math.inf`` is passed explicitly (miles' ``None`` meant "wait forever");
routing also accepts a ``fallback_url`` that acts as the ``default`` entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from posttrain.opd._errors import OPDConfigError, TeacherRoutingError

__all__ = [
    "OPDConfig",
    "RetryPolicy",
    "Strategy",
    "TeacherRouter",
    "Timeouts",
    "WeightMode",
    "parse_teacher_urls",
    "validate_url",
]

DEFAULT_TEACHER = "default"


class Strategy(StrEnum):
    """Which token ids the top-k reverse KL sums over, per response position."""

    ONLY_STUDENT = "only-student"
    ONLY_TEACHER = "only-teacher"
    INTERSECTION = "intersection"
    UNION = "union"
    XOR = "xor"


class WeightMode(StrEnum):
    """Which logprob weights each selected id (``none``: uniform)."""

    STUDENT_P = "student_p"
    TEACHER_P = "teacher_p"
    NONE = "none"


def _enum(cls: type[StrEnum], value: object, name: str) -> Any:
    try:
        return cls(value if isinstance(value, cls) else str(value))
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise OPDConfigError(f"{name}={value!r} is not one of {allowed}") from None


@dataclass(kw_only=True, slots=True, frozen=True)
class OPDConfig:
    """What to ask the teacher for and how to turn it into a signal.

    ``top_k = 0`` scores the sampled tokens only (``rkl = s - tau`` at train time);
    ``top_k > 0`` asks for sparse top-k logprobs and combines them per ``strategy``.
    ``per_position`` sends one id list per response position (patched SGLang,
    PR #38119) instead of one flat id set scored at every position.
    ``vocab_size``, when set, rejects token ids outside ``[0, vocab_size)`` before
    sending (out-of-range ids crash SGLang, #28088).
    """

    top_k: int = 0
    strategy: Strategy = Strategy.ONLY_STUDENT
    weight_mode: WeightMode = WeightMode.STUDENT_P
    per_position: bool = False
    kl_coef: float = 1.0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", _enum(Strategy, self.strategy, "strategy"))
        object.__setattr__(self, "weight_mode", _enum(WeightMode, self.weight_mode, "weight_mode"))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise OPDConfigError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not math.isfinite(self.kl_coef):
            raise OPDConfigError(f"kl_coef must be finite, got {self.kl_coef!r}")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise OPDConfigError(f"vocab_size must be > 0, got {self.vocab_size!r}")

    @property
    def needs_teacher_top(self) -> bool:
        """The teacher request carries ``top_logprobs_num``."""
        return self.top_k > 0 and self.strategy is not Strategy.ONLY_STUDENT

    @property
    def needs_student_top(self) -> bool:
        """Samples must carry the student's top-k rows from the rollout."""
        return self.top_k > 0 and self.strategy is not Strategy.ONLY_TEACHER

    @property
    def needs_teacher_on_student(self) -> bool:
        """The teacher scores the student's top-k ids (flat or per position)."""
        return self.top_k > 0 and self.strategy in (
            Strategy.ONLY_STUDENT,
            Strategy.UNION,
            Strategy.XOR,
        )

    @property
    def needs_student_on_teacher(self) -> bool:
        """The student router scores the teacher's top-k ids (a second request)."""
        return self.top_k > 0 and self.strategy in (
            Strategy.ONLY_TEACHER,
            Strategy.UNION,
            Strategy.XOR,
        )


def _check_seconds(name: str, value: float | None) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        raise OPDConfigError(
            f"{name} must be a number of seconds (pass math.inf to wait forever), got {value!r}"
        )
    if math.isnan(value) or value <= 0:
        raise OPDConfigError(f"{name} must be > 0 seconds, got {value!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class Timeouts:
    """Seconds; ``connect`` and ``read`` bound one attempt, ``deadline`` one sample's scoring.

    ``None`` is refused: infinity must be asked for by passing ``math.inf``.

    Defaults fit RL rollouts: a teacher request is one prefill (``max_new_tokens=0``) of
    prompt + response, seconds even for tens of thousands of tokens on a GPU teacher, plus
    queueing behind other prefills. ``read=60`` leaves an order of magnitude for that; a
    ``deadline`` of 120 s allows a retry after a timed-out attempt and bounds what a hung
    teacher costs a sample to two minutes (the earlier 300/900 s let it hold one for 15).
    Raise both for very long sequences on a slow teacher.
    """

    connect: float = 10.0
    read: float = 60.0
    deadline: float = 120.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "deadline"):
            _check_seconds(f"Timeouts.{name}", getattr(self, name))


@dataclass(kw_only=True, slots=True, frozen=True)
class RetryPolicy:
    """Full-jitter exponential backoff: sleep ``uniform(0, min(cap, base * 2**n))``.

    Retried: connection/read/write errors, timeouts, and ``statuses``; nothing else.
    """

    attempts: int = 5
    base_s: float = 0.5
    max_backoff_s: float = 8.0
    statuses: frozenset[int] = field(default_factory=lambda: frozenset({429, 500, 502, 503, 504}))

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise OPDConfigError(f"RetryPolicy.attempts must be an int, got {self.attempts!r}")
        if self.attempts < 1:
            raise OPDConfigError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if not (self.base_s >= 0 and self.max_backoff_s >= 0):
            raise OPDConfigError(
                f"RetryPolicy backoff must be >= 0, got base_s={self.base_s}, "
                f"max_backoff_s={self.max_backoff_s}"
            )

    def backoff_cap(self, retry_number: int) -> float:
        """Upper bound of the sleep before retry ``retry_number`` (0-based)."""
        return float(min(self.max_backoff_s, self.base_s * 2.0**retry_number))


def validate_url(url: str, *, what: str = "teacher URL") -> str:
    """Return ``url`` without a trailing slash; reject anything but http(s) with a host."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise OPDConfigError(f"{what} {url!r} must use http or https")
    if not parts.hostname:
        raise OPDConfigError(f"{what} {url!r} has no host")
    return url.rstrip("/")


def parse_teacher_urls(specs: Iterable[str] | None) -> dict[str, str]:
    """Parse ``["NAME=URL", ...]`` into ``{name: url}``; split at the first ``=``."""
    if not specs:
        return {}
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, url = spec.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url:
            raise OPDConfigError(f"Invalid teacher spec {spec!r}: expected NAME=URL")
        if name in out:
            raise OPDConfigError(f"Duplicate teacher name {name!r} in {spec!r}")
        out[name] = validate_url(url, what=f"teacher {name!r} URL")
    return out


class TeacherRouter:
    """Resolve a sample's teacher from ``metadata[key]`` (compared as ``str``).

    With no named URLs every sample goes to ``fallback_url``. Otherwise a known name
    goes to its URL; a missing or unknown name goes to the ``default`` entry (or
    ``fallback_url``), else :class:`TeacherRoutingError`.
    """

    __slots__ = ("_default", "key", "urls")

    def __init__(
        self,
        urls: Mapping[str, str] | None = None,
        fallback_url: str | None = None,
        key: str = "opd_teacher",
    ) -> None:
        self.urls = {
            name: validate_url(u, what=f"teacher {name!r} URL") for name, u in (urls or {}).items()
        }
        self.key = key
        default = self.urls.get(DEFAULT_TEACHER)
        if default is None and fallback_url is not None:
            default = validate_url(fallback_url, what="fallback teacher URL")
        if not self.urls and default is None:
            raise OPDConfigError("TeacherRouter needs teacher URLs or a fallback_url")
        self._default = default

    @property
    def all_urls(self) -> list[str]:
        """Every distinct URL this router can return, in a stable order."""
        seen = dict.fromkeys(self.urls.values())
        if self._default is not None:
            seen.setdefault(self._default)
        return list(seen)

    def resolve(self, metadata: Mapping[str, object] | None) -> tuple[str, str]:
        """Return ``(teacher_name, url)`` for one sample."""
        if not self.urls:
            assert self._default is not None  # checked in __init__
            return DEFAULT_TEACHER, self._default
        meta = metadata or {}
        if self.key not in meta or meta[self.key] is None:
            if self._default is not None:
                return DEFAULT_TEACHER, self._default
            raise TeacherRoutingError(
                f"Sample metadata is missing teacher key {self.key!r} and no 'default' "
                f"teacher is configured (teachers: {sorted(self.urls)})"
            )
        name = str(meta[self.key])
        url = self.urls.get(name)
        if url is not None:
            return name, url
        if self._default is not None:
            return DEFAULT_TEACHER, self._default
        raise TeacherRoutingError(
            f"Teacher key {self.key!r}={name!r} matches no configured teacher name "
            f"(teachers: {sorted(self.urls)}) and no 'default' teacher is configured"
        )
