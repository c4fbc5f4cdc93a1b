"""posttrain.opd: on-policy-distillation teacher scoring.

Config and routing (:mod:`~posttrain.opd.config`), the pure SGLang ``/generate`` scoring
protocol with flat and per-position sparse top-k (:mod:`~posttrain.opd.protocol`), a
bounded sharded async client (:class:`TeacherScoringClient`), float32 detached reverse-KL
signals (:mod:`~posttrain.opd.signals`) and compact log summaries. The loopback teacher
for tests lives in :mod:`posttrain.opd.testing` (not imported here).
"""

from posttrain.opd._errors import (
    CapabilityError,
    MissingLogprobError,
    OPDConfigError,
    OPDError,
    ScoringInputError,
    StudentTopLogprobsError,
    TeacherRejectedError,
    TeacherResponseError,
    TeacherRoutingError,
    TeacherUnavailableError,
)
from posttrain.opd.client import (
    EquivalenceReport,
    OPDSignals,
    ScoreStats,
    ScoringSample,
    TeacherScoringClient,
    student_top_rows,
)
from posttrain.opd.config import (
    OPDConfig,
    RetryPolicy,
    Strategy,
    TeacherRouter,
    Timeouts,
    WeightMode,
    parse_teacher_urls,
    validate_url,
)
from posttrain.opd.protocol import (
    ScoreView,
    build_score_payload,
    flat_token_ids,
    parse_score_response,
    per_position_ids,
    summarize_response,
)
from posttrain.opd.signals import (
    apply_opd,
    cp_response_index,
    sampled_reverse_kl,
    select_ids,
    slice_response_for_cp,
    topk_reverse_kl,
)
from posttrain.opd.summary import summarize_batch

__all__ = [
    "CapabilityError",
    "EquivalenceReport",
    "MissingLogprobError",
    "OPDConfig",
    "OPDConfigError",
    "OPDError",
    "OPDSignals",
    "RetryPolicy",
    "ScoreStats",
    "ScoreView",
    "ScoringInputError",
    "ScoringSample",
    "Strategy",
    "StudentTopLogprobsError",
    "TeacherRejectedError",
    "TeacherResponseError",
    "TeacherRouter",
    "TeacherRoutingError",
    "TeacherScoringClient",
    "TeacherUnavailableError",
    "Timeouts",
    "WeightMode",
    "apply_opd",
    "build_score_payload",
    "cp_response_index",
    "flat_token_ids",
    "parse_score_response",
    "parse_teacher_urls",
    "per_position_ids",
    "sampled_reverse_kl",
    "select_ids",
    "slice_response_for_cp",
    "student_top_rows",
    "summarize_batch",
    "summarize_response",
    "topk_reverse_kl",
    "validate_url",
]
