"""The errors posttrain.opd raises, written out once.

    PosttrainError (posttrain.interface)
    └── OPDError                              base of every opd-scoring error
        ├── OPDConfigError (ConfigError)      bad option or teacher URL spec ("expected NAME=URL", ...)
        ├── TeacherRoutingError (ValueError)  a sample's metadata matches no teacher and no default
        ├── ScoringInputError (ValueError)    a sample cannot be scored as given (P = 0, ids outside
        │   │                                 the vocabulary, rows of the wrong length)
        │   ├── StudentTopLogprobsError       student top-k rows missing or not R long
        │   └── MissingLogprobError           a selected token id has no student/teacher logprob
        ├── TeacherResponseError (WireFormatError, ValueError)
        │                                     a teacher/student reply failed validation; carries
        │                                     url, sample_index and reason (never retried)
        ├── TeacherUnavailableError (TransportError)
        │                                     retries or the deadline ran out; carries url,
        │                                     attempts, elapsed_s and the last cause
        ├── TeacherRejectedError (EngineError)
        │                                     the server answered a non-retryable status (400,
        │                                     404, ...); carries url and status (never retried)
        └── CapabilityError (TransportError)  the server lacks a needed feature (per-position ids)

Every message names the URL, sample index, field or token id at fault.
"""

from __future__ import annotations

from posttrain.interface import (
    ConfigError,
    EngineError,
    PosttrainError,
    TransportError,
    WireFormatError,
)


class OPDError(PosttrainError):
    """Base class of every error raised by posttrain.opd."""


class OPDConfigError(OPDError, ConfigError):
    """An OPD option or teacher URL spec is invalid."""


class TeacherRoutingError(OPDError, ValueError):
    """A sample's routing key matches no configured teacher and there is no default."""


class ScoringInputError(OPDError, ValueError):
    """A sample (or signal tensor) cannot be scored as given; the message names it."""


class StudentTopLogprobsError(ScoringInputError):
    """The student's top-k rows are missing or not one per response token."""


class MissingLogprobError(ScoringInputError):
    """A token id selected by the strategy has no student or teacher logprob."""


class TeacherResponseError(OPDError, WireFormatError):
    """A scoring reply failed validation (never retried: the same request gives the same reply)."""

    def __init__(
        self,
        reason: str,
        *,
        url: str | None = None,
        sample_index: int | None = None,
        field: str | None = None,
    ) -> None:
        where = f"teacher {url!r}" if url else "teacher response"
        idx = f" sample {sample_index}" if sample_index is not None else ""
        super().__init__(f"{where}{idx}: {reason}", field=field)
        self.url = url
        self.sample_index = sample_index
        self.reason = reason


class TeacherUnavailableError(OPDError, TransportError):
    """Every attempt failed with a retryable error, or the deadline ran out."""

    def __init__(
        self,
        message: str,
        *,
        url: str,
        attempts: int,
        elapsed_s: float,
        cause: BaseException | None,
        status: int | None = None,
    ) -> None:
        super().__init__(
            f"{message} (url={url!r}, attempts={attempts}, elapsed={elapsed_s:.3f}s, "
            f"cause={cause!r})",
            url=url,
        )
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.cause = cause
        self.status = status


class CapabilityError(OPDError, TransportError):
    """The server does not support a feature the configuration needs."""


class TeacherRejectedError(OPDError, EngineError):
    """The server answered a status that retrying cannot fix (a 4xx other than 429)."""
