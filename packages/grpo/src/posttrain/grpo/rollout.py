"""Rollouts: n samples per prompt, each through its own session-router session.

Per sample: open a session, send one OpenAI chat turn (``/sessions/{id}/v1/chat/completions``),
collect the session's training sample (samples/1, decoded to an interface ``Sample`` with the
engine's exact token ids and logprobs), delete the session. The session router renders the chat
template, routes by session id through sgl-router and adds ``lora_path`` when it serves the
adapter; this module also sends ``lora_path``/``extra_key`` (``request_fields``) on every turn
when an adapter is trained, so prefix caches never mix adapter versions.

Determinism (a resumed run must roll out exactly what an uninterrupted one does): each sample's
sampling seed is a hash of (run seed, step, prompt index, sample index), sent as OpenAI
``seed`` (the session router maps it to SGLang's ``sampling_seed``, which sgl-router keeps;
it drops ``sampling_params.seed``). With strict kernels the engine's tokens then do not depend
on batching or on which engine served the session.

Every request is bounded: a finite timeout per HTTP call and at most ``concurrency`` sessions
in flight.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from posttrain.formats import decode_samples
from posttrain.grpo._errors import GrpoRunError
from posttrain.grpo.rewards import Prompt
from posttrain.interface import Sample


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
    concurrency: int = 32


def sampling_seed(seed: int, step: int, prompt_index: int, sample: int) -> int:
    """A 31-bit seed that depends only on (run seed, step, prompt, sample)."""
    digest = hashlib.sha256(f"{seed}/{step}/{prompt_index}/{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _checked(reply: httpx.Response, what: str) -> httpx.Response:
    if reply.status_code >= 300:
        raise GrpoRunError(
            f"rollout: {what} {reply.request.url} answered {reply.status_code}: {reply.text[:300]}"
        )
    return reply


async def _one_sample(
    client: httpx.AsyncClient,
    settings: RolloutSettings,
    prompt: Prompt,
    *,
    step: int,
    group: int,
    sample: int,
) -> Sample:
    base = settings.url.rstrip("/")
    opened = _checked(
        await client.post(f"{base}/sessions", json={"weight_version": settings.weight_version}),
        "POST",
    )
    session = str(opened.json()["session_id"])
    try:
        body: dict[str, Any] = {
            "messages": list(prompt.messages),
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "seed": sampling_seed(settings.seed, step, prompt.index, sample),
            "logprobs": True,
        }
        if settings.top_logprobs:
            body["top_logprobs"] = settings.top_logprobs
        chat = f"{base}/sessions/{session}/v1/chat/completions"
        _checked(await client.post(chat, json=body), "POST")
        meta = {**prompt.metadata, "prompt_index": prompt.index}
        collected = _checked(
            await client.post(f"{base}/sessions/{session}/samples", json={"metadata": meta}),
            "POST",
        )
        decoded = decode_samples(collected.content)
        if len(decoded.samples) != 1:
            raise GrpoRunError(
                f"rollout: session {session} assembled {len(decoded.samples)} samples "
                f"({decoded.empty_reason}); expected one per chat turn"
            )
        out = decoded.samples[0]
        out.group_index = group
        out.index = group * settings.samples_per_prompt + sample
        return out
    finally:
        await client.delete(f"{base}/sessions/{session}")


async def rollout(
    settings: RolloutSettings,
    prompts: Sequence[Prompt],
    *,
    step: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Sample]:
    """``samples_per_prompt`` samples per prompt, in (prompt, sample) order."""
    gate = asyncio.Semaphore(settings.concurrency)
    timeout = httpx.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 10.0))
    limits = httpx.Limits(max_connections=settings.concurrency)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, transport=transport, headers=headers
    ) as client:

        async def bounded(prompt: Prompt, group: int, sample: int) -> Sample:
            async with gate:
                try:
                    return await _one_sample(
                        client, settings, prompt, step=step, group=group, sample=sample
                    )
                except httpx.HTTPError as exc:
                    raise GrpoRunError(
                        f"rollout: {settings.url} failed for prompt {prompt.index} sample "
                        f"{sample}: {type(exc).__name__}: {exc}"
                    ) from exc

        jobs = [
            bounded(prompt, g, j)
            for g, prompt in enumerate(prompts)
            for j in range(settings.samples_per_prompt)
        ]
        return list(await asyncio.gather(*jobs))


def run_rollout(
    settings: RolloutSettings,
    prompts: Sequence[Prompt],
    *,
    step: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Sample]:
    """``rollout`` from synchronous code (one event loop per step)."""
    return asyncio.run(rollout(settings, prompts, step=step, transport=transport))
