"""Training samples from a session's committed turns: trim, truncate, merge.

Per turn i with prompt P, output O and logprobs L, against the conversation's accumulated ids A:
the output tokens that A does not continue with are trimmed (a stop token the next turn's
template replaced); only ``max_trim_tokens`` may be trimmed, none from the last turn. Each turn
becomes a ``Sample(prompt=P, response=O', logprobs=L', loss_mask=1s)``.

Truncation comes before merging: turns are kept while ``len(tokens) <= max_seq_len``; the first
turn that overflows loses its overshoot and is marked truncated if any output remains, or is
dropped, and nothing after it is kept.

Merging goes left to right and stops after a turn that did not complete. Between two turns the
tokens the engine did not generate (tool output, user text, template glue) are observation tokens:
they enter the response with loss mask 0 and logprob 0.0, so one sample carries the whole
trajectory and the trainer recomputes logprobs over exactly the engine's tokens.

Student top-k rows for on-policy distillation: when the turns asked for top logprobs (OpenAI
``top_logprobs: k``, sent upstream as ``top_logprobs_num``), each reply's
``meta_info.output_top_logprobs`` rows ride along through trim, truncation and merge, and the
sample's ``metadata["opd_student_top_logprobs"]`` holds one row per response token (``[]`` for
observation tokens), the layout ``posttrain.opd`` scores. If any merged turn lacks them the key
is left out rather than filled with empty rows (which would read as "no student ids here").

Media: a turn's request names every image and audio item of its prompt (``image_data``,
``audio_data``), so each turn's sample carries them as ``Sample.media`` and the merged sample
carries the last merged turn's. An earlier turn's media must be a prefix of a later one's, per
kind, as its tokens are of the later prompt; otherwise the trajectory is refused (422).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.formats import STUDENT_TOP_LOGPROBS_KEY
from posttrain.interface import (
    WEIGHT_VERSIONS_KEY,
    ConfigError,
    MediaKind,
    MediaRef,
    Sample,
    SampleStatus,
    WireFormatError,
    media_from_request,
    parse_weight_version,
)
from posttrain.session_router._errors import SampleAssemblyError
from posttrain.session_router.tito import TurnRecord

_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "tool_calls": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


def status_of(finish_reason: str) -> SampleStatus:
    """The sample status of an engine finish reason (unknown reasons count as aborted)."""
    return _STATUS.get(finish_reason, SampleStatus.ABORTED)


@dataclass(frozen=True, slots=True, kw_only=True)
class AssembledSamples:
    """The result of ``assemble_samples``: 0 or 1 sample, and why it is empty when it is."""

    samples: list[Sample]
    empty_reason: str | None
    session_metadata: dict[str, Any]


def _weight_version(record: TurnRecord) -> int | None:
    """The engine's version of the turn's weights (SGLang sends a string; ours is an int)."""
    meta = record.response.get("meta_info")
    value = meta.get("weight_version") if isinstance(meta, dict) else None
    try:
        return parse_weight_version(value, field="meta_info.weight_version")
    except WireFormatError as exc:
        raise SampleAssemblyError(f"a turn's reply: {exc}") from exc


def _top_rows(record: TurnRecord, index: int) -> list[Any] | None:
    """The reply's ``output_top_logprobs`` rows, one per output token, or None if not asked."""
    meta = record.response.get("meta_info")
    rows = meta.get("output_top_logprobs") if isinstance(meta, dict) else None
    if rows is None:
        return None
    if not isinstance(rows, list) or len(rows) != len(record.output_ids):
        count = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise SampleAssemblyError(
            f"records[{index}]: meta_info.output_top_logprobs has {count} rows for "
            f"{len(record.output_ids)} output tokens"
        )
    return [[] if row is None else row for row in rows]


def trim_turns(
    records: Sequence[TurnRecord], accumulated: Sequence[int], *, max_trim_tokens: int
) -> list[Sample]:
    """One sample per turn with the tokens the conversation did not keep trimmed off (422 on misuse)."""
    turns: list[Sample] = []
    cursor = 0
    for i, rec in enumerate(records):
        prompt, output = rec.prompt_ids, rec.output_ids
        if list(accumulated[: len(prompt)]) != list(prompt):
            raise SampleAssemblyError(
                f"records[{i}]: prompt_ids are not a prefix of the accumulated token ids"
            )
        cursor = len(prompt)
        matched = 0
        while (
            matched < len(output)
            and cursor + matched < len(accumulated)
            and output[matched] == accumulated[cursor + matched]
        ):
            matched += 1
        trim = len(output) - matched
        allowed = 0 if i == len(records) - 1 else max_trim_tokens
        if trim > allowed:
            raise SampleAssemblyError(
                f"records[{i}]: {trim} output tokens are not in the accumulated ids "
                f"(at most {allowed} may be trimmed from this turn)"
            )
        cursor += matched
        rows = _top_rows(rec, i)
        try:
            media = media_from_request(rec.request)
        except ConfigError as exc:
            raise SampleAssemblyError(f"records[{i}].request: {exc}") from exc
        turns.append(
            Sample(
                prompt_ids=list(prompt),
                response_ids=list(output[:matched]),
                rollout_logprobs=list(rec.output_logprobs[:matched]),
                loss_mask=[1] * matched,
                status=status_of(rec.finish_reason),
                weight_version=_weight_version(rec),
                metadata={} if rows is None else {STUDENT_TOP_LOGPROBS_KEY: rows[:matched]},
                media=media,
            )
        )
    if records and cursor != len(accumulated):
        raise SampleAssemblyError(
            f"records end at token {cursor} but the session accumulated {len(accumulated)} tokens"
        )
    return turns


def truncate_turns(turns: Sequence[Sample], max_seq_len: int | None) -> list[Sample]:
    """Keep turns while they fit ``max_seq_len``; cut the first overflowing one (or drop it) and stop."""
    if max_seq_len is None:
        return list(turns)
    kept: list[Sample] = []
    for turn in turns:
        overshoot = len(turn.tokens) - max_seq_len
        if overshoot <= 0:
            kept.append(turn)
            continue
        keep = turn.response_length - overshoot
        if keep > 0:
            kept.append(
                Sample(
                    prompt_ids=turn.prompt_ids,
                    response_ids=turn.response_ids[:keep],
                    rollout_logprobs=turn.rollout_logprobs[:keep],
                    loss_mask=turn.loss_mask[:keep],
                    status=SampleStatus.TRUNCATED,
                    weight_version=turn.weight_version,
                    metadata={k: v[:keep] for k, v in turn.metadata.items()},
                    media=turn.media,
                )
            )
        break
    return kept


def _media_prefix(before: list[MediaRef], after: list[MediaRef], kind: MediaKind) -> bool:
    a = [m for m in before if m.kind is kind]
    b = [m for m in after if m.kind is kind]
    return b[: len(a)] == a


def merge_turns(turns: Sequence[Sample]) -> tuple[Sample | None, int]:
    """Merge turns left to right into one trajectory; stop after the first non-completed turn.

    Returns the merged sample and how many turns went into it.
    """
    if not turns:
        return None, 0
    merged = turns[0]
    used = 1
    for i, nxt in enumerate(turns[1:], start=1):
        if merged.status is not SampleStatus.COMPLETED:
            break
        a_tokens, b_tokens = merged.tokens, nxt.tokens
        obs = len(b_tokens) - len(a_tokens) - nxt.response_length
        if obs <= 0 or b_tokens[: len(a_tokens)] != a_tokens:
            raise SampleAssemblyError(
                f"turns[{i}]: the previous turns' tokens are not a strict prefix of its prompt "
                f"(observation length {obs})"
            )
        for kind in MediaKind:
            if not _media_prefix(merged.media, nxt.media, kind):
                raise SampleAssemblyError(
                    f"turns[{i}]: the previous turns' {kind.request_field} is not a prefix of "
                    "this turn's (a turn's request names every media item of its prompt)"
                )
        rows_a, rows_b = (
            merged.metadata.get(STUDENT_TOP_LOGPROBS_KEY),
            nxt.metadata.get(STUDENT_TOP_LOGPROBS_KEY),
        )
        merged = Sample(
            prompt_ids=merged.prompt_ids,
            response_ids=merged.response_ids + b_tokens[len(a_tokens) :],
            rollout_logprobs=merged.rollout_logprobs + [0.0] * obs + nxt.rollout_logprobs,
            loss_mask=merged.loss_mask + [0] * obs + nxt.loss_mask,
            status=nxt.status,
            weight_version=nxt.weight_version,
            metadata={}
            if rows_a is None or rows_b is None
            else {STUDENT_TOP_LOGPROBS_KEY: rows_a + [[]] * obs + rows_b},
            media=nxt.media,
        )
        used += 1
    return merged, used


def assemble_samples(
    records: Sequence[TurnRecord],
    accumulated: Sequence[int],
    *,
    max_trim_tokens: int,
    max_seq_len: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    session_metadata: Mapping[str, Any] | None = None,
) -> AssembledSamples:
    """Assemble a session's records into 0 or 1 training sample (see the module docstring)."""
    if max_seq_len is not None and max_seq_len <= 0:
        raise SampleAssemblyError(f"max_seq_len must be positive or null, got {max_seq_len}")
    session_meta = dict(session_metadata or {})
    if not records:
        return AssembledSamples(
            samples=[], empty_reason="no_records", session_metadata=session_meta
        )
    turns = truncate_turns(
        trim_turns(records, accumulated, max_trim_tokens=max_trim_tokens), max_seq_len
    )
    merged, used = merge_turns(turns)
    if merged is None:
        return AssembledSamples(
            samples=[], empty_reason="all_truncated", session_metadata=session_meta
        )
    merged.metadata = {
        **merged.metadata,
        **dict(metadata or {}),
        "num_turns": len(records),
        "merged_turns": used,
        WEIGHT_VERSIONS_KEY: [_weight_version(r) for r in records],
    }
    return AssembledSamples(samples=[merged], empty_reason=None, session_metadata=session_meta)
