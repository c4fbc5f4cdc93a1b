"""Clients of the session server: a synchronous one per session, and a ``RolloutEngine``.

``SessionClient`` is what a rollout driver with its own agent uses: ``create()`` opens a session
(optionally naming the adapter version its LoRA requests carry), ``base_url(id)`` is what an
OpenAI SDK agent is pointed at, ``collect(id)`` fetches the assembled sample (samples/1, decoded
by ``posttrain.formats``, optionally overlaid on the driver's own sample) and ``close(id)``
deletes the session.

``SessionRolloutClient`` implements the interface's ``RolloutEngine`` for single-turn chat
rollouts (or raw-prompt ones, ``prompt=``, for base models without a chat template): one session per rollout (create, one chat turn, collect, delete, the delete even when
a step failed), so each sample carries exactly the engine's token ids and logprobs, and its
session's id in ``metadata["session_id"]``.
``rollout_group`` draws the n samples of one prompt concurrently (a GRPO group), one session
per request; ``rollout_n`` sends them as one request (``POST /rollouts``: the session server
runs the n sessions itself), so a group costs one HTTP round trip instead of 4n.

With ``turn_timeout_s`` set, a turn that gets no reply within that deadline (the client's own
wall-clock deadline, or the session server's 504 when its ``upstream_timeout_s`` passes first:
an engine that froze) does not raise: the rollout returns a ``Sample`` with status ``aborted``,
no tokens, and ``metadata["abort_reason"]`` and ``metadata["session_id"]``; the session is
deleted (the session server never commits a turn its client left). Without it a timeout is an
error, as before. Any other failure (a 502, a refused connection) still raises.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from posttrain.formats import DecodedSamples, decode_samples
from posttrain.interface import (
    ABORT_REASON_KEY,
    SESSION_ID_KEY,
    ConfigError,
    MediaRef,
    Sample,
    SampleGroup,
    SampleStatus,
    TransportError,
    media_request_fields,
)
from posttrain.session_router._errors import SampleAssemblyError, SessionNotFoundError
from posttrain.session_router.config import is_positive_seconds


def _check(reply: httpx.Response, session_id: str | None = None) -> httpx.Response:
    """The reply if it succeeded; else the error its status means (404, 422, any other)."""
    if reply.status_code == 404 and session_id is not None:
        raise SessionNotFoundError(session_id)
    if reply.status_code == 422:
        raise SampleAssemblyError(reply.text)
    if reply.status_code >= 400:
        raise TransportError(
            f"{reply.request.method} {reply.request.url.path} answered {reply.status_code}: "
            f"{reply.text[:300]}",
            url=str(reply.request.url),
        )
    return reply


def _create_body(weight_version: int | None) -> dict[str, Any]:
    return {} if weight_version is None else {"weight_version": weight_version}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class SessionClient:
    """Talks to one session server; the httpx transport is injectable, the timeout finite."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    def create(self, *, weight_version: int | None = None) -> str:
        """Open a session whose LoRA requests name adapter version ``weight_version``; its id."""
        reply = _check(self._client.post("/sessions", json=_create_body(weight_version)))
        return str(reply.json()["session_id"])

    def base_url(self, session_id: str) -> str:
        """The OpenAI ``base_url`` of a session (``.../sessions/{id}/v1``)."""
        return f"{self.url}/sessions/{session_id}/v1"

    def get(self, session_id: str) -> dict[str, Any]:
        """The session's records and metadata."""
        reply = _check(self._client.get(f"/sessions/{session_id}"), session_id)
        data: dict[str, Any] = reply.json()
        return data

    def collect(
        self,
        session_id: str,
        *,
        max_seq_len: int | None = None,
        metadata: dict[str, Any] | None = None,
        base: Sample | None = None,
    ) -> DecodedSamples:
        """The session's assembled samples (0 or 1), overlaid onto ``base`` when given."""
        reply = _check(
            self._client.post(
                f"/sessions/{session_id}/samples",
                json={"max_seq_len": max_seq_len, "metadata": metadata or {}},
            ),
            session_id,
        )
        return decode_samples(reply.content, base=base)

    def close(self, session_id: str) -> None:
        """Delete the session (``SessionNotFoundError`` if it is already gone)."""
        _check(self._client.delete(f"/sessions/{session_id}"), session_id)

    def shutdown(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()


class SessionRolloutClient:
    """A ``RolloutEngine``: one single-turn chat rollout per session of one session server.

    ``max_concurrency`` bounds the rollouts in flight (``rollout_group`` draws n at once).
    ``turn_timeout_s`` (None: off) is the deadline of one chat turn, past which the rollout
    returns an aborted sample instead of raising (see the module docstring).
    The httpx transport is injectable; every timeout is finite.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        turn_timeout_s: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if turn_timeout_s is not None and not is_positive_seconds(turn_timeout_s):
            raise ConfigError(
                f"turn_timeout_s must be a finite number > 0 or None, got {turn_timeout_s!r}"
            )
        self.turn_timeout_s = turn_timeout_s
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )
        self._slots = asyncio.Semaphore(max_concurrency)

    async def __aenter__(self) -> SessionRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        await self._client.aclose()

    async def rollout(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        weight_version: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        media: Sequence[MediaRef] = (),
        prompt: str | Sequence[int] | None = None,
    ) -> Sample:
        """One sample for ``messages``: the turn's token ids, logprobs and loss mask.

        ``prompt`` (with ``messages`` empty) is a raw prompt instead, a text or token ids sent
        to ``/sessions/{id}/v1/completions`` without a chat template (a base model).

        ``media`` (the prompt's images and audio, one per sentinel in its text) is sent as
        ``image_data``/``audio_data`` and comes back on the sample.

        ``sampling_params`` are OpenAI chat fields (``max_tokens``, ``temperature``, ``seed``...);
        ``metadata`` goes into the sample's ``metadata`` (the session server merges it).
        Raises ``SampleAssemblyError`` when the session assembled no sample, and the session
        server's errors as ``SessionRouterError`` / ``TransportError``. With ``turn_timeout_s``
        set, a turn with no reply within it returns an ``aborted`` sample (no tokens).
        """
        async with self._slots:
            reply = _check(await self._client.post("/sessions", json=_create_body(weight_version)))
            session_id = str(reply.json()["session_id"])
            try:
                body = {**dict(sampling_params or {}), **media_request_fields(media)}
                if prompt is not None:
                    body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
                else:
                    body["messages"] = list(messages)
                aborted = await self._turn(session_id, body, raw=prompt is not None)
                if aborted is None:
                    reply = _check(
                        await self._client.post(
                            f"/sessions/{session_id}/samples",
                            json={"metadata": dict(metadata or {})},
                        ),
                        session_id,
                    )
            except BaseException:
                # Best effort: a failing delete must not hide why the rollout failed.
                with contextlib.suppress(httpx.HTTPError):
                    await self._client.delete(f"/sessions/{session_id}")
                raise
            _check(await self._client.delete(f"/sessions/{session_id}"), session_id)
        if aborted is not None:
            return Sample(
                prompt_ids=[], response_ids=[], rollout_logprobs=[], loss_mask=[],
                status=SampleStatus.ABORTED,
                metadata={**dict(metadata or {}), SESSION_ID_KEY: session_id,
                          ABORT_REASON_KEY: aborted},
            )  # fmt: skip
        decoded = decode_samples(reply.content)
        if len(decoded.samples) != 1:
            raise SampleAssemblyError(
                f"session {session_id} assembled {len(decoded.samples)} samples "
                f"({decoded.empty_reason or 'expected exactly 1'})"
            )
        sample = decoded.samples[0]
        sample.metadata.setdefault(SESSION_ID_KEY, session_id)  # which session drew it
        return sample

    async def _turn(
        self, session_id: str, body: dict[str, Any], *, raw: bool = False
    ) -> str | None:
        """Send one chat (or, ``raw``, completions) turn: None when it was answered, else why it
        was aborted (only with ``turn_timeout_s``: no reply within it, or the session server's
        upstream 504)."""
        route = "v1/completions" if raw else "v1/chat/completions"
        url = f"/sessions/{session_id}/{route}"
        if self.turn_timeout_s is None:
            _check(await self._client.post(url, json=body), session_id)
            return None
        deadline = f"no reply within turn_timeout_s={self.turn_timeout_s:g} s"
        try:
            async with asyncio.timeout(self.turn_timeout_s):
                reply = await self._client.post(url, json=body)
        except (TimeoutError, httpx.TimeoutException):
            return deadline
        if reply.status_code == 504:
            return f"the session server's upstream call timed out (504): {reply.text[:300]}"
        _check(reply, session_id)
        return None

    async def rollout_n(
        self,
        messages: Sequence[Mapping[str, Any]],
        n: int,
        *,
        seeds: Sequence[int] | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        weight_version: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        media: Sequence[MediaRef] = (),
        prompt: str | Sequence[int] | None = None,
    ) -> list[Sample]:
        """``n`` samples of one prompt in one request (``POST /rollouts``), in order.

        The session server runs each as its own session, exactly as ``rollout`` does (the same
        records, token ids and logprobs), with the n turns upstream at once; ``seeds[i]`` is
        sample i's OpenAI ``seed``. ``turn_timeout_s`` applies per sample (an ``aborted`` sample
        in its place); any other failure of a sample raises, naming the sample.
        """
        if n < 1:
            raise ConfigError(f"a group needs n >= 1 samples, got {n}")
        if seeds is not None and len(seeds) != n:
            raise ConfigError(f"seeds: {len(seeds)} given for n={n} samples")
        turn: dict[str, Any] = {**dict(sampling_params or {}), **media_request_fields(media)}
        if prompt is not None:
            turn["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        else:
            turn["messages"] = list(messages)
        body: dict[str, Any] = {"n": n, "turn": turn, "metadata": dict(metadata or {})}
        if seeds is not None:
            body["seeds"] = list(seeds)
        if weight_version is not None:
            body["weight_version"] = weight_version
        if self.turn_timeout_s is not None:
            body["turn_timeout_s"] = self.turn_timeout_s
        async with self._slots:
            reply = _check(await self._client.post("/rollouts", json=body))
        decoded = decode_samples(reply.content)
        if len(decoded.samples) != n:
            raise SampleAssemblyError(
                f"POST /rollouts returned {len(decoded.samples)} samples for n={n}"
            )
        return decoded.samples

    async def rollout_group(
        self,
        messages: Sequence[Mapping[str, Any]],
        n: int,
        *,
        group_index: int,
        sampling_params: Mapping[str, Any] | None = None,
        weight_version: int | None = None,
        media: Sequence[MediaRef] = (),
    ) -> SampleGroup:
        """The ``n`` samples of one prompt, drawn concurrently (``index`` 0..n-1 within the group).

        Each request samples on its own: a fixed ``seed`` in ``sampling_params`` would make the
        n samples equal.
        """
        if n < 1:
            raise ConfigError(f"a group needs n >= 1 samples, got {n}")
        samples = await asyncio.gather(
            *(
                self.rollout(
                    messages,
                    sampling_params=sampling_params,
                    weight_version=weight_version,
                    media=media,
                )
                for _ in range(n)
            )
        )
        for index, sample in enumerate(samples):
            sample.group_index, sample.index = group_index, index
        return SampleGroup(group_index=group_index, samples=list(samples))
