"""The teacher scoring protocol: SGLang's native ``POST /generate``, one sample per request.

Pure functions, no I/O. A request scores ``tokens`` (prompt + response, length
L = P + R, P >= 1) with ``max_new_tokens = 0``; every ``input_*`` list in the reply
has L rows indexed by absolute position, row 0 a placeholder, and the response
span is rows P..L-1 (``values[1:][-R:]``).

Two ways to ask for logprobs of chosen ids (never both in one request):
flat ``token_ids_logprob`` (one sorted id set scored at EVERY position, so the reply
grows as O(L * k * R)) and per-position ``token_ids_logprob_positions`` (one list per
position, P empty lists first; patched SGLang only, reply O(R * k)).

Departure from SGLang clients that trust the reply: :func:`parse_score_response`
checks lengths, nulls, non-finite values and that every echoed token id equals the
input (tokenizer or offset drift), and returns only the response span restricted
to the ids that were asked for, so flat and per-position replies parse to equal views.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from posttrain.opd._errors import ScoringInputError, TeacherResponseError

__all__ = [
    "ScoreView",
    "build_score_payload",
    "flat_token_ids",
    "parse_score_response",
    "per_position_ids",
    "summarize_response",
]

Need = Literal["top", "ids"]

TOKEN_FIELD = "input_token_logprobs"
TOP_FIELD = "input_top_logprobs"
IDS_FIELD = "input_token_ids_logprobs"


def _check_ids(ids: Iterable[int], what: str, vocab_size: int | None) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ScoringInputError(f"{what}: token id {t!r} is not an int")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ScoringInputError(f"{what}: token id {t} is outside [0, {vocab_size})")


def flat_token_ids(rows: Iterable[Iterable[int]]) -> list[int]:
    """The flat id set: the sorted union of every row's ids."""
    return sorted({t for row in rows for t in row})


def per_position_ids(rows: Sequence[Iterable[int]], prompt_len: int) -> list[list[int]]:
    """Lay out R response rows as L = P + R position lists: P empty lists, then one per token.

    Row r lands at index P + r, the same index the reply's response span is cut from.
    Ids keep their order; repeats are dropped.
    """
    if prompt_len < 1:
        raise ScoringInputError(
            f"prompt_len must be >= 1 for per-position ids (got {prompt_len}): "
            "response token 0 would land on the placeholder row 0"
        )
    return [[] for _ in range(prompt_len)] + [list(dict.fromkeys(row)) for row in rows]


def build_score_payload(
    input_ids: Sequence[int],
    *,
    top_k: int = 0,
    token_ids: Iterable[int] | None = None,
    positions: Sequence[Sequence[int]] | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Build a ``/generate`` scoring request; ``token_ids`` (flat) and ``positions`` exclude each other.

    ``positions`` must hold one list per input position (see :func:`per_position_ids`).
    An empty flat id set omits the key.
    """
    ids = list(input_ids)
    if not ids:
        raise ScoringInputError("input_ids is empty")
    _check_ids(ids, "input_ids", vocab_size)
    if top_k < 0:
        raise ScoringInputError(f"top_k must be >= 0, got {top_k}")
    if token_ids is not None and positions is not None:
        raise ScoringInputError(
            "token_ids (flat) and positions (per-position) are exclusive; pass one of them"
        )
    payload: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if top_k > 0:
        payload["top_logprobs_num"] = top_k
    if token_ids is not None:
        flat = sorted(set(token_ids))
        _check_ids(flat, "token_ids_logprob", vocab_size)
        if flat:
            payload["token_ids_logprob"] = flat
    if positions is not None:
        if len(positions) != len(ids):
            raise ScoringInputError(
                f"token_ids_logprob_positions has {len(positions)} lists, expected one per "
                f"input position ({len(ids)})"
            )
        rows = [list(row) for row in positions]
        for i, row in enumerate(rows):
            _check_ids(row, f"token_ids_logprob_positions[{i}]", vocab_size)
        payload["token_ids_logprob_positions"] = rows
    return payload


@dataclass(slots=True, frozen=True)
class ScoreView:
    """The validated response span (R rows) of one scoring reply.

    ``token_logprobs[r]`` is log p(x_{P+r} | x_<P+r); ``top[r]`` maps the server's top-k ids
    to logprobs; ``ids[r]`` maps exactly the ids requested for row r to logprobs.
    """

    token_logprobs: list[float]
    top: list[dict[int, float]] | None = None
    ids: list[dict[int, float]] | None = None


class _Ctx:
    __slots__ = ("index", "url")

    def __init__(self, url: str | None, index: int | None) -> None:
        self.url = url
        self.index = index

    def fail(self, reason: str, field: str) -> TeacherResponseError:
        return TeacherResponseError(reason, url=self.url, sample_index=self.index, field=field)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _value(x: object, ctx: _Ctx, field: str) -> float:
    if not _is_number(x):
        raise ctx.fail(f"{field} is {x!r}, expected a logprob", field)
    v = float(x)  # type: ignore[arg-type]
    if not math.isfinite(v):
        raise ctx.fail(f"{field} is non-finite ({v})", field)
    return v


def _rows(meta: Mapping[str, Any], name: str, length: int, ctx: _Ctx) -> list[Any]:
    if name not in meta:
        raise ctx.fail(f"meta_info has no {name!r}", f"meta_info.{name}")
    rows = meta[name]
    if not isinstance(rows, list):
        raise ctx.fail(f"meta_info.{name} is {type(rows).__name__}, expected a list", name)
    if len(rows) != length:
        raise ctx.fail(
            f"meta_info.{name} has {len(rows)} rows, expected {length} (one per input token)",
            f"meta_info.{name}",
        )
    return rows


def _row_map(row: object, ctx: _Ctx, field: str) -> dict[int, Any]:
    if not isinstance(row, list):
        raise ctx.fail(f"{field} is {row!r}, expected a list of [logprob, id, ...] entries", field)
    out: dict[int, Any] = {}
    for j, entry in enumerate(row):
        if not isinstance(entry, list | tuple) or not 2 <= len(entry) <= 3:
            raise ctx.fail(f"{field}[{j}] is {entry!r}, expected [logprob, id(, text)]", field)
        tid = entry[1]
        if isinstance(tid, bool) or not isinstance(tid, int):
            raise ctx.fail(f"{field}[{j}] has token id {tid!r}, expected an int", field)
        out[tid] = entry[0]
    return out


def parse_score_response(
    obj: object,
    input_ids: Sequence[int],
    response_len: int,
    need: Iterable[Need] = (),
    *,
    requested: Sequence[Sequence[int]] | None = None,
    url: str | None = None,
    sample_index: int | None = None,
) -> ScoreView:
    """Validate a reply and return its response span.

    ``need`` names the optional fields to read: ``"top"`` (``input_top_logprobs``) and
    ``"ids"`` (``input_token_ids_logprobs``; ``requested`` then gives the R id lists
    that must come back, flat or per-position alike). Raises
    :class:`TeacherResponseError` naming the URL, sample index and reason.
    """
    ctx = _Ctx(url, sample_index)
    needs = set(need)
    n = len(input_ids)
    if not 0 <= response_len <= n - 1:
        raise ScoringInputError(
            f"sample {sample_index}: response_len {response_len} needs 0 <= R <= L - 1 = {n - 1}"
        )
    start = n - response_len
    if not isinstance(obj, dict):
        raise ctx.fail(f"reply is {type(obj).__name__}, expected a JSON object", "")
    if "meta_info" not in obj:
        raise ctx.fail("reply has no meta_info", "meta_info")
    meta = obj["meta_info"]
    if not isinstance(meta, dict):
        raise ctx.fail(f"meta_info is {type(meta).__name__}, expected an object", "meta_info")

    token_rows = _rows(meta, TOKEN_FIELD, n, ctx)
    token_lp: list[float] = []
    for i, entry in enumerate(token_rows):
        f = f"meta_info.{TOKEN_FIELD}[{i}]"
        if not isinstance(entry, list | tuple) or not 2 <= len(entry) <= 3:
            raise ctx.fail(f"{f} is {entry!r}, expected [logprob, id(, text)]", f)
        if entry[1] != input_ids[i]:
            raise ctx.fail(
                f"{f} echoes token id {entry[1]!r} but input_ids[{i}] is {input_ids[i]} "
                "(tokenizer or offset drift)",
                f,
            )
        if i >= start:
            token_lp.append(_value(entry[0], ctx, f"{f}[0]"))

    top: list[dict[int, float]] | None = None
    if "top" in needs:
        rows = _rows(meta, TOP_FIELD, n, ctx)
        top = []
        for i in range(start, n):
            f = f"meta_info.{TOP_FIELD}[{i}]"
            m = _row_map(rows[i], ctx, f)
            if not m:
                raise ctx.fail(f"{f} is empty in the response span", f)
            top.append({t: _value(v, ctx, f"{f}[id={t}]") for t, v in m.items()})

    ids: list[dict[int, float]] | None = None
    if "ids" in needs:
        if requested is None or len(requested) != response_len:
            raise ScoringInputError(
                f"sample {sample_index}: 'ids' needs {response_len} requested rows, got "
                f"{None if requested is None else len(requested)}"
            )
        rows = _rows(meta, IDS_FIELD, n, ctx)
        ids = []
        for r, want in enumerate(requested):
            i = start + r
            f = f"meta_info.{IDS_FIELD}[{i}]"
            if not want:
                ids.append({})
                continue
            if rows[i] is None:
                raise ctx.fail(
                    f"{f} is null but ids {list(want)[:8]} were requested (server ignored them?)",
                    f,
                )
            m = _row_map(rows[i], ctx, f)
            got: dict[int, float] = {}
            for t in want:
                if t not in m:
                    raise ctx.fail(f"{f} lacks requested token id {t}", f)
                got[t] = _value(m[t], ctx, f"{f}[id={t}]")
            ids.append(got)
    return ScoreView(token_logprobs=token_lp, top=top, ids=ids)


_META_KEYS = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version")


def summarize_response(obj: object, *, preview_chars: int = 512) -> dict[str, Any]:
    """A compact log line for a reply: keys, a few meta fields, ``{type, len}`` per list.

    Never the payload itself: a flat reply can be hundreds of megabytes.
    """
    if not isinstance(obj, dict):
        return {"type": type(obj).__name__}
    out: dict[str, Any] = {"keys": sorted(obj)}
    text = obj.get("text")
    if isinstance(text, str):
        out["text"] = text[:preview_chars]
        out["text_len"] = len(text)
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        out["meta_keys"] = sorted(meta)
        for k in _META_KEYS:
            if k in meta:
                out[k] = meta[k]
        out["lists"] = {
            k: {"type": type(v).__name__, "len": len(v)}
            for k, v in sorted(meta.items())
            if isinstance(v, list)
        }
    elif meta is not None:
        out["meta_info_type"] = type(meta).__name__
    return out
