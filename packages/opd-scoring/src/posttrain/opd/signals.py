"""Reverse-KL OPD signals in pure torch: float32, detached, never in place.

Sampled (``top_k = 0``): ``rkl_t = s_t - tau_t`` with s the old-policy (or rollout)
student logprob of the sampled token and tau the teacher's.

Top-k, per response position t, from four id -> logprob maps: S (student top-k),
T (teacher top-k), TS (teacher on student ids), ST (student on teacher ids). The
strategy picks an ordered id set V_t; a_v = S[v] else ST[v], b_v = T[v] else TS[v];
w = softmax over V_t of a (student_p), b (teacher_p) or 0 (none); ``xor`` uses the
unnormalised exp weights instead; ``rkl_t = sum_v w_v (a_v - b_v)``, 0 on an empty set.

Departure from the paper's Eq. 5: the log-ratios are NOT renormalised over V_t, so
k = 1 still carries signal. Stop-gradient (miles c783b2986): every input is detached
where it enters and every output is a fresh tensor without a graph.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from posttrain.opd._errors import MissingLogprobError, ScoringInputError, StudentTopLogprobsError
from posttrain.opd.config import Strategy, WeightMode

__all__ = [
    "apply_opd",
    "cp_response_index",
    "sampled_reverse_kl",
    "select_ids",
    "slice_response_for_cp",
    "topk_reverse_kl",
]

Rows = Sequence[Mapping[int, float]]


def select_ids(
    student: Mapping[int, float] | None,
    teacher: Mapping[int, float] | None,
    strategy: Strategy,
) -> list[int]:
    """The ordered id set V_t of one position for ``strategy``."""
    s = list(student or ())
    t = list(teacher or ())
    if strategy is Strategy.ONLY_STUDENT:
        return s
    if strategy is Strategy.ONLY_TEACHER:
        return t
    tset, sset = set(t), set(s)
    if strategy is Strategy.INTERSECTION:
        return [v for v in s if v in tset]
    if strategy is Strategy.UNION:
        return s + [v for v in t if v not in sset]
    return [v for v in s if v not in tset] + [v for v in t if v not in sset]  # xor


def _lookup(
    v: int, primary: Mapping[int, float] | None, other: Mapping[int, float] | None, who: str, t: int
) -> float:
    if primary is not None and v in primary:
        return float(primary[v])
    if other is not None and v in other:
        return float(other[v])
    raise MissingLogprobError(f"Missing {who} logprob for token id {v} at response position {t}")


def _position_rkl(
    t: int,
    s: Mapping[int, float] | None,
    tt: Mapping[int, float] | None,
    ts: Mapping[int, float] | None,
    st: Mapping[int, float] | None,
    strategy: Strategy,
    weight_mode: WeightMode,
) -> float:
    ids = select_ids(s, tt, strategy)
    if not ids:
        return 0.0
    a = [_lookup(v, s, st, "student", t) for v in ids]
    b = [_lookup(v, tt, ts, "teacher", t) for v in ids]
    logits = (
        a
        if weight_mode is WeightMode.STUDENT_P
        else b
        if weight_mode is WeightMode.TEACHER_P
        else [0.0] * len(ids)
    )
    if strategy is Strategy.XOR:
        w = [math.exp(x) for x in logits]
    else:
        m = max(logits)
        e = [math.exp(x - m) for x in logits]
        z = sum(e)
        w = [x / z for x in e]
    return math.fsum(wi * (ai - bi) for wi, ai, bi in zip(w, a, b, strict=True))


def topk_reverse_kl(
    student_top: Rows | None,
    teacher_top: Rows | None,
    teacher_on_student: Rows | None,
    student_on_teacher: Rows | None,
    strategy: Strategy | str,
    weight_mode: WeightMode | str = WeightMode.STUDENT_P,
) -> torch.Tensor:
    """Per-position top-k reverse KL, float32[R]; pass ``None`` for maps a strategy does not use."""
    strategy = Strategy(strategy)
    weight_mode = WeightMode(weight_mode)
    given = {
        "student_top": student_top,
        "teacher_top": teacher_top,
        "teacher_on_student": teacher_on_student,
        "student_on_teacher": student_on_teacher,
    }
    lengths = {k: len(v) for k, v in given.items() if v is not None}
    if not lengths:
        raise ScoringInputError("topk_reverse_kl needs at least one of the four logprob maps")
    if len(set(lengths.values())) != 1:
        raise ScoringInputError(f"topk_reverse_kl rows disagree in length: {lengths}")
    if student_top is None and strategy is not Strategy.ONLY_TEACHER:
        raise StudentTopLogprobsError(f"strategy {strategy.value} needs the student's top-k rows")
    (r,) = set(lengths.values())

    def row(x: Rows | None, t: int) -> Mapping[int, float] | None:
        return None if x is None else x[t]

    vals = [
        _position_rkl(
            t,
            row(student_top, t),
            row(teacher_top, t),
            row(teacher_on_student, t),
            row(student_on_teacher, t),
            strategy,
            weight_mode,
        )
        for t in range(r)
    ]
    return torch.tensor(vals, dtype=torch.float64).to(torch.float32)


def _as_f32(x: torch.Tensor | Sequence[float], name: str) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=torch.float64)
    if t.dim() != 1:
        raise ScoringInputError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(torch.float32)


def sampled_reverse_kl(
    student_logp: torch.Tensor | Sequence[float], teacher_logp: torch.Tensor | Sequence[float]
) -> torch.Tensor:
    """``s - tau`` on the sampled tokens, float32, detached."""
    s = _as_f32(student_logp, "student_logp")
    t = _as_f32(teacher_logp, "teacher_logp")
    if s.shape != t.shape:
        raise ScoringInputError(
            f"student_logp shape {tuple(s.shape)} != teacher_logp shape {tuple(t.shape)}"
        )
    return s - t


def apply_opd(
    advantages: Sequence[torch.Tensor],
    *,
    coef: float,
    reverse_kl: Sequence[torch.Tensor | None] | None = None,
    old_logp: Sequence[torch.Tensor] | None = None,
    teacher_logp: Sequence[torch.Tensor | None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample: ``A - coef * rkl`` (new tensors, float32, no graph) and the rkl used.

    A precomputed ``reverse_kl[i]`` wins; otherwise rkl = ``old_logp[i] - teacher_logp[i]``.
    A length mismatch raises :class:`ScoringInputError` naming the sample index.
    """
    n = len(advantages)
    for name, seq in (
        ("reverse_kl", reverse_kl),
        ("old_logp", old_logp),
        ("teacher_logp", teacher_logp),
    ):
        if seq is not None and len(seq) != n:
            raise ScoringInputError(f"{name} has {len(seq)} samples, advantages has {n}")
    new_adv: list[torch.Tensor] = []
    rkls: list[torch.Tensor] = []
    for i, adv in enumerate(advantages):
        a = adv.detach().to(torch.float32)
        pre = reverse_kl[i] if reverse_kl is not None else None
        if pre is not None:
            rkl = pre.detach().to(torch.float32)
        else:
            tl = teacher_logp[i] if teacher_logp is not None else None
            if tl is None or old_logp is None:
                raise ScoringInputError(
                    f"sample {i}: needs reverse_kl, or old_logp and teacher_logp"
                )
            try:
                rkl = sampled_reverse_kl(old_logp[i], tl)
            except ScoringInputError as e:
                raise ScoringInputError(f"sample {i}: {e}") from None
        if rkl.shape != a.shape:
            raise ScoringInputError(
                f"sample {i}: reverse KL shape {tuple(rkl.shape)} != advantages shape "
                f"{tuple(a.shape)}"
            )
        new_adv.append(a - coef * rkl)
        rkls.append(rkl.clone())
    return new_adv, rkls


def cp_response_index(
    total_len: int,
    resp_len: int,
    cp_rank: int,
    cp_size: int,
    fmt: Literal["thd", "bshd"] = "thd",
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Response positions (int64, ascending) that context-parallel rank ``cp_rank`` owns.

    Zigzag layout: the sequence (``bshd``: padded to ``max_seq_len``) is cut into 2n
    chunks of c = ceil(T / 2n); rank r owns chunks r and 2n - r - 1. Each chunk is
    clipped to the logit range [P - 1, T - 1) and shifted by P - 1, exactly as
    rollout logprobs are sliced. The ranks' indices partition ``range(resp_len)``.
    """
    prompt_len = total_len - resp_len
    if resp_len < 0 or prompt_len < 1:
        raise ScoringInputError(
            f"total_len {total_len} must exceed resp_len {resp_len} by at least 1 (prompt)"
        )
    if not 0 <= cp_rank < cp_size:
        raise ScoringInputError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return torch.arange(resp_len)
    if fmt == "thd":
        span = total_len
    elif fmt == "bshd":
        if max_seq_len is None or max_seq_len < total_len:
            raise ScoringInputError(
                f"bshd needs max_seq_len >= total_len={total_len}, got {max_seq_len}"
            )
        span = max_seq_len
    else:
        raise ScoringInputError(f"fmt must be 'thd' or 'bshd', got {fmt!r}")
    c = -(-span // (2 * cp_size))
    lo, hi = prompt_len - 1, total_len - 1
    parts = []
    for chunk in (cp_rank, 2 * cp_size - cp_rank - 1):
        s, e = max(chunk * c, lo), min((chunk + 1) * c, hi)
        if s < e:
            parts.append(torch.arange(s - lo, e - lo))
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(parts)


def slice_response_for_cp(
    x: torch.Tensor,
    total_len: int,
    resp_len: int,
    cp_rank: int,
    cp_size: int,
    fmt: Literal["thd", "bshd"] = "thd",
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """This context-parallel rank's part of an R-long response signal (see :func:`cp_response_index`).

    Dtype kept (float32 signals stay float32); the result is detached.
    """
    if x.dim() != 1 or x.shape[0] != resp_len:
        raise ScoringInputError(f"signal shape {tuple(x.shape)} != (resp_len={resp_len},)")
    idx = cp_response_index(total_len, resp_len, cp_rank, cp_size, fmt, max_seq_len)
    return x.detach()[idx]
