"""The Protocols that decouple packages: who produces rollouts, scores, rewards and takes weights.

A GRPO loop talks to these, never to a concrete engine or client, so a session server in front
of SGLang, a local CPU engine and a test double are interchangeable. Each is
``runtime_checkable`` and has a real implementation that a test checks with ``isinstance``:

- ``RolloutEngine``: ``posttrain.session_router.SessionRolloutClient`` (one session per rollout);
- ``TeacherScorer``: ``posttrain.opd.TeacherScoringClient``;
- ``WeightSink``: ``posttrain.formats.WeightPushClient`` (wsync/1 over HTTP or shared memory);
- ``RewardFunction``: the reward functions of ``posttrain.grpo``.

``RewardInput`` is what a text-level reward reads (the decoded response, the prompt, the label,
the row's metadata and the sample); it returns a finite number or ``{"reward": x, **metrics}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.interface._samples import Sample, TeacherScores
from posttrain.interface._weight_sync import BucketManifest, WeightUpdateBegin, WeightUpdateResult


@runtime_checkable
class RolloutEngine(Protocol):
    """Turns one chat prompt into one training sample (token ids, rollout logprobs, loss mask).

    ``sampling_params`` are OpenAI/SGLang sampling fields (``max_tokens``, ``temperature``...).
    ``weight_version`` is the policy version the caller has pushed to the engines; an engine
    that serves a LoRA adapter tags its requests with it (``extra_key``), so prefix-cache entries
    never cross versions. The sample carries the version the engine reported.
    """

    async def rollout(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        weight_version: int | None = None,
    ) -> Sample:
        """One sample for ``messages`` (raises when the engine produced none)."""
        ...


@runtime_checkable
class TeacherScorer(Protocol):
    """Scores the response tokens of student samples with a teacher model."""

    async def score_batch(self, samples: Sequence[Sample]) -> Sequence[TeacherScores]:
        """One ``TeacherScores`` per sample, in input order."""
        ...


@runtime_checkable
class RewardFunction(Protocol):
    """Maps a finished sample to a scalar reward.

    The Protocol's signature is the original form (one ``sample`` in, a float out), which keeps
    working. ``posttrain.grpo`` binds a reward's parameters by name, so a reward may instead
    take any of ``response`` (decoded text), ``prompt``, ``label``, ``metadata``, ``sample``
    and ``input`` (a ``RewardInput``), or their plurals (``responses``, ..., ``inputs``) to
    score a whole step's samples in one call; it may be ``async``; it returns a finite number
    or ``{"reward": x, **extra_metrics}`` (one per sample when batched).
    """

    def __call__(self, sample: Sample) -> float: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardInput:
    """What a reward reads about one finished sample.

    ``prompt`` is the prompt as the data gave it: a text, or the chat messages. ``label`` is the
    row's label (``--label-key``; None without one), ``metadata`` its metadata
    (``--metadata-key``; empty without one).
    """

    response: str
    prompt: str | tuple[Mapping[str, Any], ...]
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    sample: Sample | None = None


@runtime_checkable
class WeightSink(Protocol):
    """Receives a weight update (``wsync/1``): begin, buckets, end; or abort.

    ``payload`` holds the bucket's packed bytes (``manifest.total_bytes`` of them, tensors at
    the manifest's aligned offsets).
    """

    def begin(self, header: WeightUpdateBegin) -> None: ...

    def send_bucket(
        self, manifest: BucketManifest, payload: bytes | bytearray | memoryview
    ) -> None: ...

    def end(self, update_id: str) -> WeightUpdateResult: ...

    def abort(self, update_id: str) -> None: ...
