"""The async teacher client: bounded, sharded, retrying, fail-fast, results in input order.

Departures from miles' aiohttp code (a new session per request, no retries, ``None``
timeout meaning "wait forever"):

* Sharded httpx pools: one ``httpx.AsyncClient`` pool of 64 connections reached
  38-52 req/s against a 200 ms teacher (ideal 320), so each URL gets
  ceil(per_url_concurrency / connections_per_client) pools of a few connections
  and a request goes to the least-loaded one. Each pool is an
  ``httpx.AsyncHTTPTransport`` that requests are sent on directly: the client layer
  above it (URL merging, cookie extraction, auth and redirect hooks) cost ~0.3 ms of
  CPU per request, a third of httpx's share, and scoring uses none of it.
* Concurrency bounds: a global semaphore and one per URL, held only while a request
  is on the wire (not during backoff).
* Finite timeouts (:class:`Timeouts`); the deadline of a sample starts when its first
  request gets a slot (time queued behind the bounds is not charged), covers every
  attempt, backoff and the student request, and cuts a hanging read short.
* Retries with full-jitter backoff only on connection/read/write errors, timeouts and
  429/500/502/503/504; a 4xx is :class:`TeacherRejectedError` and a malformed reply
  :class:`TeacherResponseError` at once (retrying gives the same answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, cast, overload

import httpx
import torch

from posttrain.formats import STUDENT_TOP_LOGPROBS_KEY
from posttrain.interface import PositionScores, Sample, TeacherScores
from posttrain.opd._errors import (
    CapabilityError,
    OPDConfigError,
    ScoringInputError,
    StudentTopLogprobsError,
    TeacherRejectedError,
    TeacherResponseError,
    TeacherUnavailableError,
)
from posttrain.opd.config import OPDConfig, RetryPolicy, TeacherRouter, Timeouts, validate_url
from posttrain.opd.protocol import (
    Need,
    ScoreView,
    build_score_payload,
    parse_score_response,
    per_position_ids,
    summarize_response,
)
from posttrain.opd.signals import topk_reverse_kl

__all__ = [
    "EquivalenceReport",
    "OPDSignals",
    "ScoreStats",
    "ScoringSample",
    "TeacherScoringClient",
    "student_top_rows",
]

log = logging.getLogger("posttrain.opd")

_RETRYABLE = (
    httpx.ConnectError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.TimeoutException,
)


@dataclass(kw_only=True, slots=True, frozen=True)
class ScoringSample:
    """What scoring needs of a rollout sample: ``tokens`` = prompt + response ids.

    ``student_top`` holds R rows of the student's top-k ``{id: logprob}`` from the
    rollout (``meta_info.output_top_logprobs``); needed unless top_k = 0 or only-teacher.
    An interface :class:`~posttrain.interface.Sample` converts with :meth:`from_sample`.
    """

    tokens: Sequence[int]
    response_length: int
    metadata: Mapping[str, object] = field(default_factory=dict)
    student_top: Sequence[Mapping[int, float]] | None = None

    @classmethod
    def from_sample(cls, sample: Sample, *, key: str = STUDENT_TOP_LOGPROBS_KEY) -> ScoringSample:
        """Take tokens, metadata and ``metadata[key]`` (student top-k rows) from a Sample."""
        raw = sample.metadata.get(key)
        return cls(
            tokens=sample.tokens,
            response_length=sample.response_length,
            metadata=sample.metadata,
            student_top=None if raw is None else student_top_rows(raw, field=key),
        )


def student_top_rows(
    raw: object, *, field: str = STUDENT_TOP_LOGPROBS_KEY
) -> list[dict[int, float]]:
    """Normalise stored student top-k rows to ``[{id: logprob}]``.

    Accepts SGLang's ``output_top_logprobs`` rows (``[[logprob, id, text|null], ...]``,
    ``null`` or ``[]`` for observation tokens), ``{id: logprob}`` maps (keys may be
    strings after a JSON round trip) and :class:`~posttrain.interface.PositionScores`.
    """
    if not isinstance(raw, list | tuple):
        raise StudentTopLogprobsError(f"{field} is {type(raw).__name__}, expected a list of rows")
    rows: list[dict[int, float]] = []
    for t, row in enumerate(raw):
        try:
            if row is None:
                rows.append({})
            elif isinstance(row, PositionScores):
                rows.append(row.as_dict())
            elif isinstance(row, Mapping):
                rows.append({int(k): float(v) for k, v in row.items()})
            else:
                rows.append({int(e[1]): float(e[0]) for e in row})
        except (TypeError, ValueError, IndexError) as e:
            raise StudentTopLogprobsError(
                f"{field}[{t}] is malformed ({e}): {row!r:.200}"
            ) from None
        if not all(math.isfinite(v) for v in rows[-1].values()):
            raise StudentTopLogprobsError(f"{field}[{t}] holds a non-finite logprob")
    return rows


@dataclass(kw_only=True, slots=True)
class ScoreStats:
    """Wire cost of one sample: bytes sent and received, wall time, requests and HTTP attempts."""

    requests: int = 0
    request_bytes: int = 0
    response_bytes: int = 0
    latency_s: float = 0.0
    attempts: int = 0


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class OPDSignals(TeacherScores):
    """A sample's teacher scores (the interface view) plus the OPD signal and wire stats.

    ``sampled_logprobs``: the teacher's logprob of each sampled response token;
    ``positions[t]``: the teacher's logprobs on the ids it was asked about at t
    (its top-k, then the student's ids; empty when top_k = 0); ``reverse_kl``:
    float32[R], detached, None when top_k = 0 (the sampled signal needs the
    trainer's old logprobs: :func:`~posttrain.opd.apply_opd`).
    """

    reverse_kl: torch.Tensor | None = None
    stats: ScoreStats = field(default_factory=ScoreStats)

    @property
    def teacher_log_probs(self) -> torch.Tensor | None:
        """``sampled_logprobs`` as a float32[R] tensor."""
        if self.sampled_logprobs is None:
            return None
        return torch.tensor(self.sampled_logprobs, dtype=torch.float32)


@dataclass(kw_only=True, slots=True)
class EquivalenceReport:
    """Flat vs per-position on the same samples: largest difference and byte totals."""

    samples: int
    max_abs_diff: float
    mismatched: list[int]
    flat_response_bytes: int
    per_position_response_bytes: int
    atol: float

    @property
    def ok(self) -> bool:
        """Every sample matched within ``atol``."""
        return not self.mismatched


class _Deadline:
    __slots__ = ("at", "seconds", "started")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at: float | None = None
        self.started = time.monotonic()

    def start(self) -> None:
        if self.at is None:
            self.at = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return math.inf if self.at is None else self.at - time.monotonic()


class _Endpoint:
    """One URL: its shard clients, their loads and its concurrency bound."""

    def __init__(self, url: str, transports: list[httpx.AsyncBaseTransport], bound: int) -> None:
        self.url = url
        self.generate_url = httpx.URL(f"{url}/generate")
        self.transports = transports
        self.load = [0] * len(transports)
        self.sem = asyncio.Semaphore(bound)

    def pick(self) -> int:
        return min(range(len(self.load)), key=self.load.__getitem__)


def _httpx_seconds(x: float) -> float | None:
    return None if math.isinf(x) else x


def _probe_rows(obj: object) -> object:
    """Rows 1..2 of a probe reply's ``input_token_ids_logprobs`` as sorted id lists."""
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    rows = meta.get("input_token_ids_logprobs") if isinstance(meta, dict) else None
    if not isinstance(rows, list) or len(rows) != 3:
        return rows
    try:
        return [sorted(e[1] for e in row) if isinstance(row, list) else row for row in rows[1:]]
    except (TypeError, IndexError):
        return rows[1:]


class TeacherScoringClient:
    """Score rollout samples against teacher servers (``async with TeacherScoringClient(...)``).

    It is the interface's ``TeacherScorer``: ``score_batch`` returns one ``OPDSignals`` (a
    ``TeacherScores``) per sample, in input order. ``transport`` (tests) replaces the network
    under every shard client.
    """

    def __init__(
        self,
        router: TeacherRouter,
        cfg: OPDConfig,
        *,
        student_url: str | None = None,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        max_concurrency: int = 256,
        per_url_concurrency: int = 64,
        connections_per_client: int = 8,
        transport: httpx.AsyncBaseTransport | None = None,
        seed: int | None = None,
    ) -> None:
        for name, v in (
            ("max_concurrency", max_concurrency),
            ("per_url_concurrency", per_url_concurrency),
            ("connections_per_client", connections_per_client),
        ):
            if v < 1:
                raise OPDConfigError(f"{name} must be >= 1, got {v}")
        if cfg.needs_student_on_teacher and student_url is None:
            raise OPDConfigError(
                f"strategy {cfg.strategy.value} scores teacher ids with the student: "
                "student_url is required"
            )
        self.router = router
        self.cfg = cfg
        self.student_url = (
            None if student_url is None else validate_url(student_url, what="student URL")
        )
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self.max_concurrency = max_concurrency
        self.per_url_concurrency = per_url_concurrency
        self.connections_per_client = connections_per_client
        self._transport = transport
        self._rng = random.Random(seed)
        self._endpoints: dict[str, _Endpoint] = {}
        self._global: asyncio.Semaphore | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> TeacherScoringClient:
        t = self.timeouts
        # httpx's per-request timeout extension (what AsyncClient would attach).
        self._timeout_ext = {
            "timeout": {
                "connect": _httpx_seconds(t.connect),
                "read": _httpx_seconds(t.read),
                "write": _httpx_seconds(t.read),
                "pool": _httpx_seconds(t.connect),
            }
        }
        per_client = min(self.connections_per_client, self.per_url_concurrency)
        shards = -(-self.per_url_concurrency // per_client)
        limits = httpx.Limits(max_connections=per_client, max_keepalive_connections=per_client)
        urls = list(self.router.all_urls)
        if self.student_url is not None and self.student_url not in urls:
            urls.append(self.student_url)
        # One TLS context for every shard: building one per client costs ~10 ms each.
        tls = httpx.create_ssl_context()
        for url in urls:
            transports: list[httpx.AsyncBaseTransport] = [
                self._transport or httpx.AsyncHTTPTransport(limits=limits, verify=tls)
                for _ in range(shards)
            ]
            self._endpoints[url] = _Endpoint(url, transports, self.per_url_concurrency)
        self._global = asyncio.Semaphore(self.max_concurrency)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every shard's connection pool (an injected transport is closed once)."""
        eps, self._endpoints = self._endpoints, {}
        unique = {id(t): t for ep in eps.values() for t in ep.transports}
        for transport in unique.values():
            await transport.aclose()

    # -- one HTTP exchange with retries -------------------------------------------------------
    async def _post(
        self,
        url: str,
        payload: dict[str, Any],
        index: int | None,
        deadline: _Deadline,
        stats: ScoreStats,
    ) -> Any:
        ep = self._endpoints.get(url)
        if ep is None or self._global is None:
            raise RuntimeError(
                "TeacherScoringClient is not open: use `async with TeacherScoringClient(...)`"
            )
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"content-type": "application/json"}
        stats.requests += 1
        attempts = 0
        cause: BaseException | None = None
        status: int | None = None
        t0 = time.monotonic()

        def unavailable(
            reason: str, failure: BaseException | None, last: int | None, tries: int
        ) -> TeacherUnavailableError:
            return TeacherUnavailableError(
                reason, url=url, attempts=tries, elapsed_s=time.monotonic() - t0,
                cause=failure, status=last,
            )  # fmt: skip

        while True:
            attempts += 1
            stats.attempts += 1
            stats.request_bytes += len(body)
            resp: httpx.Response | None = None
            content = b""
            async with self._global, ep.sem:
                deadline.start()
                remaining = deadline.remaining()
                if remaining <= 0:
                    raise unavailable(
                        f"deadline of {deadline.seconds}s passed", cause, status, attempts - 1
                    )
                shard = ep.pick()
                ep.load[shard] += 1
                try:
                    async with asyncio.timeout(None if math.isinf(remaining) else remaining):
                        request = httpx.Request(
                            "POST",
                            ep.generate_url,
                            content=body,
                            headers=headers,
                            extensions=self._timeout_ext,
                        )
                        resp = await ep.transports[shard].handle_async_request(request)
                        try:
                            content = await resp.aread()
                        finally:
                            await resp.aclose()
                except TimeoutError as e:
                    raise unavailable(
                        f"deadline of {deadline.seconds}s passed during a request",
                        e,
                        None,
                        attempts,
                    ) from e
                except _RETRYABLE as e:
                    cause, status = e, None
                except httpx.HTTPError as e:
                    raise unavailable("request failed (not retryable)", e, None, attempts) from e
                finally:
                    ep.load[shard] -= 1
            if resp is not None:
                stats.response_bytes += len(content)
                if resp.status_code == 200:
                    try:
                        return json.loads(content)
                    except ValueError as e:
                        raise TeacherResponseError(
                            f"reply is not valid JSON ({e}; {len(content)} bytes)",
                            url=url,
                            sample_index=index,
                        ) from None
                status = resp.status_code
                cause = None
                if status not in self.retry.statuses:
                    raise TeacherRejectedError(
                        f"{url} answered {status} for sample {index}: "
                        f"{content[:512].decode('utf-8', 'replace')!r}",
                        url=url,
                        status=status,
                    )
            if attempts >= self.retry.attempts:
                raise unavailable(
                    f"gave up on sample {index} after {attempts} attempts (last status {status})",
                    cause, status, attempts,
                )  # fmt: skip
            sleep = self._rng.uniform(0.0, self.retry.backoff_cap(attempts - 1))
            if sleep >= deadline.remaining():
                raise unavailable(
                    f"deadline of {deadline.seconds}s would pass during backoff "
                    f"(last status {status})",
                    cause, status, attempts,
                )  # fmt: skip
            log.debug(
                "retrying %s sample %s in %.3fs (status %s, %r)", url, index, sleep, status, cause
            )
            await asyncio.sleep(sleep)

    async def _request(
        self,
        url: str,
        tokens: Sequence[int],
        resp_len: int,
        *,
        top_k: int,
        id_rows: list[list[int]] | None,
        per_position: bool,
        index: int | None,
        deadline: _Deadline,
        stats: ScoreStats,
    ) -> ScoreView:
        prompt_len = len(tokens) - resp_len
        need: list[Need] = ["top"] if top_k > 0 else []
        ask_ids = id_rows is not None and any(id_rows)
        if ask_ids:
            need.append("ids")
        if ask_ids and per_position:
            payload = build_score_payload(
                tokens,
                top_k=top_k,
                positions=per_position_ids(id_rows or [], prompt_len),
                vocab_size=self.cfg.vocab_size,
            )
        else:
            flat = [t for row in id_rows or [] for t in row] if ask_ids else None
            payload = build_score_payload(
                tokens, top_k=top_k, token_ids=flat, vocab_size=self.cfg.vocab_size
            )
        obj = await self._post(url, payload, index, deadline, stats)
        try:
            view = parse_score_response(
                obj,
                tokens,
                resp_len,
                need,
                requested=id_rows if ask_ids else None,
                url=url,
                sample_index=index,
            )
        except TeacherResponseError:
            log.warning(
                "bad scoring reply from %s (sample %s): %s", url, index, summarize_response(obj)
            )
            raise
        if id_rows is not None and not ask_ids:
            view = ScoreView(
                token_logprobs=view.token_logprobs, top=view.top, ids=[{} for _ in id_rows]
            )
        return view

    # -- one sample ----------------------------------------------------------------------------
    async def _score(
        self, sample: ScoringSample | Sample, index: int | None, per_position: bool
    ) -> OPDSignals:
        if isinstance(sample, Sample):
            sample = ScoringSample.from_sample(sample)
        cfg = self.cfg
        name, url = self.router.resolve(sample.metadata)
        tokens = list(sample.tokens)
        r = sample.response_length
        if not 0 <= r <= len(tokens) - 1:
            raise ScoringInputError(
                f"sample {index}: response_length {r} needs a prompt of >= 1 token "
                f"(tokens has {len(tokens)})"
            )
        student_rows: list[list[int]] | None = None
        if cfg.needs_student_top:
            if sample.student_top is None or len(sample.student_top) != r:
                got = None if sample.student_top is None else len(sample.student_top)
                raise StudentTopLogprobsError(
                    f"sample {index}: student top-k rows are {got}, expected {r} "
                    "(one per response token; roll out with top_logprobs_num)"
                )
            student_rows = [list(row) for row in sample.student_top]
        stats = ScoreStats()
        deadline = _Deadline(self.timeouts.deadline)
        t0 = time.monotonic()
        view = await self._request(
            url,
            tokens,
            r,
            top_k=cfg.top_k if cfg.needs_teacher_top else 0,
            id_rows=student_rows if cfg.needs_teacher_on_student else None,
            per_position=per_position,
            index=index,
            deadline=deadline,
            stats=stats,
        )
        student_on_teacher = None
        if cfg.needs_student_on_teacher:
            assert self.student_url is not None
            assert view.top is not None
            sview = await self._request(
                self.student_url,
                tokens,
                r,
                top_k=0,
                id_rows=[list(m) for m in view.top],
                per_position=per_position,
                index=index,
                deadline=deadline,
                stats=stats,
            )
            student_on_teacher = sview.ids
        rkl = None
        if cfg.top_k > 0:
            rkl = topk_reverse_kl(
                sample.student_top if cfg.needs_student_top else None,
                view.top,
                view.ids,
                student_on_teacher,
                cfg.strategy,
                cfg.weight_mode,
            )
        stats.latency_s = time.monotonic() - t0
        positions: tuple[PositionScores, ...] = ()
        if view.top is not None or view.ids is not None:
            merged = [
                {**(view.top[t] if view.top else {}), **(view.ids[t] if view.ids else {})}
                for t in range(r)
            ]
            positions = tuple(
                PositionScores(token_ids=tuple(m), logprobs=tuple(m.values())) for m in merged
            )
        return OPDSignals(
            teacher_name=name,
            sampled_logprobs=tuple(view.token_logprobs),
            positions=positions,
            reverse_kl=rkl,
            stats=stats,
        )

    async def score(self, sample: ScoringSample | Sample, index: int | None = None) -> OPDSignals:
        """Score one sample (``index`` only names it in errors)."""
        return await self._score(sample, index, self.cfg.per_position)

    @overload
    async def score_batch(
        self,
        samples: Sequence[ScoringSample | Sample],
        *,
        return_exceptions: Literal[False] = False,
    ) -> list[OPDSignals]: ...
    @overload
    async def score_batch(
        self, samples: Sequence[ScoringSample | Sample], *, return_exceptions: Literal[True]
    ) -> list[OPDSignals | BaseException]: ...
    async def score_batch(
        self, samples: Sequence[ScoringSample | Sample], *, return_exceptions: bool = False
    ) -> list[OPDSignals] | list[OPDSignals | BaseException]:
        """Score all samples concurrently; results in input order.

        Fail-fast: the first error (lowest index among those done) cancels the rest and is
        raised, unless ``return_exceptions`` puts each error in its sample's slot.
        """
        return await self._batch(samples, self.cfg.per_position, return_exceptions)

    async def _batch(
        self, samples: Sequence[ScoringSample | Sample], per_position: bool, return_exceptions: bool
    ) -> list[OPDSignals | BaseException]:
        tasks = [
            asyncio.create_task(self._score(s, i, per_position)) for i, s in enumerate(samples)
        ]
        if not tasks:
            return []
        if return_exceptions:
            return list(await asyncio.gather(*tasks, return_exceptions=True))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t in done and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    # -- capability checks ----------------------------------------------------------------------
    async def probe(self) -> dict[str, float]:
        """Check every teacher URL (and the student URL) answers a tiny scoring request.

        With ``per_position`` also check the server honours ``token_ids_logprob_positions``:
        ``input_ids=[a, b, c]`` with positions ``[[], [v], [w]]`` must return rows 1 and 2
        holding exactly v and w, else :class:`CapabilityError`. Returns seconds per URL.
        """
        out: dict[str, float] = {}
        ids, v, w = [0, 1, 2], 3, 4
        if self.cfg.vocab_size is not None and self.cfg.vocab_size < 5:
            raise OPDConfigError(f"probe needs vocab_size >= 5, got {self.cfg.vocab_size}")
        for url in self._endpoints:
            t0 = time.monotonic()
            stats = ScoreStats()
            if not self.cfg.per_position:
                obj = await self._post(
                    url, build_score_payload(ids), None, _Deadline(self.timeouts.deadline), stats
                )
                parse_score_response(obj, ids, 2, url=url)
            else:
                payload = build_score_payload(ids, positions=[[], [v], [w]])
                try:
                    obj = await self._post(
                        url, payload, None, _Deadline(self.timeouts.deadline), stats
                    )
                except TeacherRejectedError as e:
                    raise CapabilityError(
                        f"{url} rejected token_ids_logprob_positions ({e}); it needs the "
                        "per-position patch (SGLang PR #38119) or per_position=False",
                        url=url,
                    ) from e
                got = _probe_rows(obj)
                if got != [[v], [w]]:
                    raise CapabilityError(
                        f"{url} ignored token_ids_logprob_positions: rows 1..2 are {got!r}, "
                        f"expected [[{v}], [{w}]]; it needs the per-position patch "
                        "(SGLang PR #38119) or per_position=False",
                        url=url,
                    )
                parse_score_response(obj, ids, 2, ["ids"], requested=[[v], [w]], url=url)
            out[url] = time.monotonic() - t0
        return out

    async def equivalence_check(
        self, samples: Sequence[ScoringSample | Sample], atol: float = 1e-6
    ) -> EquivalenceReport:
        """Score ``samples`` flat and per-position and compare the signals, before switching modes."""
        flat = cast(list[OPDSignals], await self._batch(samples, False, False))
        per = cast(list[OPDSignals], await self._batch(samples, True, False))
        worst = 0.0
        bad: list[int] = []
        for i, (a, b) in enumerate(zip(flat, per, strict=True)):
            diff = 0.0
            for x, y in ((a.teacher_log_probs, b.teacher_log_probs), (a.reverse_kl, b.reverse_kl)):
                if (x is None) != (y is None):
                    diff = math.inf
                elif x is not None and y is not None and x.numel():
                    diff = max(diff, float((x - y).abs().max()))
            worst = max(worst, diff)
            if not diff <= atol:
                bad.append(i)
        return EquivalenceReport(
            samples=len(samples),
            max_abs_diff=worst,
            mismatched=bad,
            flat_response_bytes=sum(s.stats.response_bytes for s in flat),
            per_position_response_bytes=sum(s.stats.response_bytes for s in per),
            atol=atol,
        )
