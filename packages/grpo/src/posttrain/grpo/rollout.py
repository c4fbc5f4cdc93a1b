"""Rollouts: n samples per prompt, each through its own session-router session.

Per prompt, session-router's ``SessionRolloutClient.rollout_n`` sends one ``POST /rollouts``
carrying the group: the session router opens one session per sample, created with the served
weight version, sends its one OpenAI chat turn (a raw text prompt, ``Prompt.text``, goes the
``/v1/completions`` way instead) with the sample's own seed, assembles the session's training
sample (samples/1: the engine's exact token ids and logprobs) and deletes the session; every
group of a step goes at once, so the engines see the whole step's turns together and batch
them. One HTTP request per prompt, not four per sample; the client and its event loop live for
the whole run (``Rollouts``), so its keep-alive connections are reused step after step. The session router renders the chat template, routes by session id through sgl-router
and, when it serves the trained adapter, adds ``lora_path`` and ``extra_key`` (from the
session's weight version, ``posttrain.formats.apply_lora_fields``) to every upstream request,
so prefix caches never mix adapter versions.

Determinism (a resumed run must roll out exactly what an uninterrupted one does): a prompt's
group has a base seed, a hash of (run seed, step, prompt index), and sample j's sampling seed is
base + j, sent as OpenAI ``seed`` (the session router maps it to SGLang's ``sampling_seed``,
which sgl-router keeps; it drops ``sampling_params.seed``). Consecutive seeds let a session
router with ``--parallel-sampling`` (the local stack's) send the group as one ``/generate``
with ``sampling_params.n``: the local engine draws sample j with base + j, the very draw of
sample j's own request; distinct prompts and steps hash to distinct bases. With strict kernels the engine's tokens then do not depend
on batching or on which engine served the session.

Every request is bounded: a finite timeout per HTTP call and at most ``concurrency`` group
requests in flight (``engine_rollout``: samples). A turn with no reply within ``turn_timeout_s`` (an engine that froze) comes back as a
sample with status ``aborted`` and no tokens (``SessionRolloutClient``); the engine fleet
leaves it out of the step (``EngineFleet.screen``). Any other failure of a sample fails the rollout.

``engine_rollout`` draws the same samples from any ``RolloutEngine`` (the interface Protocol: a
user's own engine, in process): the same seeds and sampling fields, the same bounds (a deadline
per sample, at most ``concurrency`` in flight). The Protocol carries no metadata, so the prompt's
metadata (what the reward reads) and its index are set on the returned sample here.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.rewards import Prompt
from posttrain.interface import PosttrainError, RolloutEngine, Sample
from posttrain.session_router import SessionRolloutClient


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSettings:
    """Where and how to sample.

    ``weight_version`` is the version of the weights (or adapter) the engines serve: each
    session is created with it, and the session router then adds the adapter's ``lora_path``
    and ``extra_key`` (``posttrain.formats.apply_lora_fields``) to every upstream request.
    """

    url: str
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    seed: int
    top_logprobs: int = 0
    weight_version: int | None = None
    api_key: str | None = None  # the session router's bearer token
    timeout_s: float = 600.0
    turn_timeout_s: float | None = None  # None: a turn timeout is an error, not an abort
    concurrency: int = 32


def group_seed(seed: int, step: int, prompt_index: int) -> int:
    """The base seed of a prompt's group: a 30-bit hash of (run seed, step, prompt)."""
    digest = hashlib.sha256(f"{seed}/{step}/{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF


def sampling_seed(seed: int, step: int, prompt_index: int, sample: int) -> int:
    """Sample ``sample``'s seed: its group's base plus ``sample`` (below 2**31 for any group of
    up to 2**30 samples), which is how an engine seeds the samples of one ``n`` request."""
    return group_seed(seed, step, prompt_index) + sample


async def rollout(
    settings: RolloutSettings,
    prompts: Sequence[Prompt],
    *,
    step: int,
    transport: httpx.AsyncBaseTransport | None = None,
    client: SessionRolloutClient | None = None,
) -> list[Sample]:
    """``samples_per_prompt`` samples per prompt, in (prompt, sample) order.

    Each prompt's group is one ``POST /rollouts`` (``SessionRolloutClient.rollout_n``): its n
    samples, with their own seeds, run as n sessions on the session router, every group of the
    step at once. ``client`` is a client kept across steps (``Rollouts``); without it one is
    opened for this call.
    """
    if client is None:
        async with _session_client(settings, transport) as own:
            return await rollout(settings, prompts, step=step, client=own)

    async def group(g: int, prompt: Prompt) -> list[Sample]:
        seeds = [
            sampling_seed(settings.seed, step, prompt.index, j)
            for j in range(settings.samples_per_prompt)
        ]
        try:
            out = await client.rollout_n(
                prompt.messages,
                settings.samples_per_prompt,
                seeds=seeds,
                sampling_params=_sampling_params(settings, step, prompt, None),
                weight_version=settings.weight_version,
                metadata={**prompt.metadata, "prompt_index": prompt.index},
                media=prompt.media,
                prompt=prompt.text,  # a raw text prompt: no chat template (base models)
            )
        except (PosttrainError, httpx.HTTPError) as exc:
            raise GrpoRunError(
                f"rollout: {settings.url} failed for prompt {prompt.index}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return [_placed(s, settings, g, j) for j, s in enumerate(out)]

    groups = await asyncio.gather(*(group(g, p) for g, p in enumerate(prompts)))
    return [s for samples in groups for s in samples]


def _session_client(
    settings: RolloutSettings, transport: httpx.AsyncBaseTransport | None
) -> SessionRolloutClient:
    """A session-router client for ``settings`` (its bounds: ``concurrency`` groups in flight)."""
    return SessionRolloutClient(
        settings.url,
        api_key=settings.api_key,
        timeout_s=settings.timeout_s,
        max_concurrency=settings.concurrency,
        turn_timeout_s=settings.turn_timeout_s,
        transport=transport,
    )


async def _every_sample(
    settings: RolloutSettings,
    prompts: Sequence[Prompt],
    one: Callable[[Prompt, int, int], Awaitable[Sample]],
) -> list[Sample]:
    """``one(prompt, group, sample)`` for every sample of every prompt, in that order."""
    jobs = [
        one(prompt, g, j) for g, prompt in enumerate(prompts)
        for j in range(settings.samples_per_prompt)
    ]  # fmt: skip
    return list(await asyncio.gather(*jobs))


def _placed(out: Sample, settings: RolloutSettings, group: int, sample: int) -> Sample:
    """``out`` with its place in the step: its prompt's group, its index in the batch."""
    out.group_index = group
    out.index = group * settings.samples_per_prompt + sample
    return out


def _sampling_params(
    settings: RolloutSettings, step: int, prompt: Prompt, sample: int | None
) -> dict[str, Any]:
    """The turn's sampling fields; ``sample`` None: no seed (a group sends one per sample)."""
    params: dict[str, Any] = {
        "max_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "logprobs": True,
    }
    if sample is not None:
        params["seed"] = sampling_seed(settings.seed, step, prompt.index, sample)
    if settings.top_logprobs:
        params["top_logprobs"] = settings.top_logprobs
    return params


async def engine_rollout(
    engine: RolloutEngine,
    settings: RolloutSettings,
    prompts: Sequence[Prompt],
    *,
    step: int,
) -> list[Sample]:
    """``samples_per_prompt`` samples per prompt from ``engine``, in (prompt, sample) order."""
    gate = asyncio.Semaphore(settings.concurrency)
    name = type(engine).__name__
    if any(p.text is not None for p in prompts):
        raise GrpoRunError(
            f"rollout: engine {name} is a RolloutEngine, whose rollout takes chat messages; raw "
            "text prompts (--no-apply-chat-template) roll out through the session router"
        )
    if any(p.media for p in prompts):
        raise GrpoRunError(
            f"rollout: engine {name} is a RolloutEngine, whose rollout takes no media; a "
            "multimodal task rolls out through the session router (--rollout-url)"
        )

    async def one(prompt: Prompt, group: int, sample: int) -> Sample:
        where = f"rollout: engine {name} for prompt {prompt.index} sample {sample}"
        async with gate:
            try:
                out = await asyncio.wait_for(
                    engine.rollout(
                        prompt.messages,
                        sampling_params=_sampling_params(settings, step, prompt, sample),
                        weight_version=settings.weight_version,
                    ),
                    timeout=settings.timeout_s,
                )
            except TimeoutError as exc:
                raise GrpoRunError(f"{where}: no sample within {settings.timeout_s} s") from exc
            except Exception as exc:  # a user's engine may raise anything: name where it did
                raise GrpoRunError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, Sample):
            raise GrpoRunError(f"{where}: returned {type(out).__name__}, not a Sample")
        out.metadata = {**out.metadata, **prompt.metadata, "prompt_index": prompt.index}
        return _placed(out, settings, group, sample)

    return await _every_sample(settings, prompts, one)


class Rollouts:
    """Rank 0's rollouts for a whole run: one event loop and one keep-alive session-router
    client (or the plugged ``engine``), made once and reused by every step (``close()`` ends
    them). Rebuilding them per step cost a loop, a client and new connections each step."""

    def __init__(
        self,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        engine: RolloutEngine | None = None,
    ) -> None:
        self._runner = asyncio.Runner()
        self._transport = transport
        self._engine = engine
        self._client: SessionRolloutClient | None = None
        self._client_for: tuple[Any, ...] | None = None

    def __enter__(self) -> Rollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self, settings: RolloutSettings, prompts: Sequence[Prompt], *, step: int
    ) -> list[Sample]:
        """One step's samples (``rollout``, or ``engine_rollout`` with a plugged engine)."""
        if self._engine is not None:
            return self._runner.run(engine_rollout(self._engine, settings, prompts, step=step))
        return self._runner.run(self._rollout(settings, prompts, step))

    async def _rollout(
        self, settings: RolloutSettings, prompts: Sequence[Prompt], step: int
    ) -> list[Sample]:
        # The client's own settings; the weight version and seeds travel per request.
        key = (settings.url, settings.api_key, settings.timeout_s, settings.concurrency,
               settings.turn_timeout_s)  # fmt: skip
        if self._client is None or self._client_for != key:
            if self._client is not None:
                await self._client.aclose()
            self._client, self._client_for = _session_client(settings, self._transport), key
        return await rollout(settings, prompts, step=step, client=self._client)

    def close(self) -> None:
        """Close the client's connections and the event loop."""
        try:
            if self._client is not None:
                self._runner.run(self._client.aclose())
                self._client = None
        finally:
            self._runner.close()


def run_rollout(
    settings: RolloutSettings,
    prompts: Sequence[Prompt],
    *,
    step: int,
    transport: httpx.AsyncBaseTransport | None = None,
    engine: RolloutEngine | None = None,
) -> list[Sample]:
    """``rollout`` (or, given ``engine``, ``engine_rollout``) from synchronous code, once (a loop
    of several steps keeps a ``Rollouts``)."""
    with Rollouts(transport=transport, engine=engine) as rollouts:
        return rollouts.run(settings, prompts, step=step)
