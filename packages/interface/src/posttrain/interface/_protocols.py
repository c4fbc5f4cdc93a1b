"""The Protocols that decouple packages: who produces rollouts, scores, rewards and takes weights.

A GRPO loop talks to these, never to a concrete engine or client, so a session server in front
of SGLang, a local CPU engine and a test double are interchangeable. Each is
``runtime_checkable`` and has a real implementation that a test checks with ``isinstance``:

- ``RolloutEngine``: ``posttrain.session_router.SessionRolloutClient`` (one session per rollout);
- ``TeacherScorer``: ``posttrain.opd.TeacherScoringClient``;
- ``WeightSink``: ``posttrain.formats.WeightPushClient`` (wsync/1 over HTTP or shared memory);
- ``RewardFunction``: the reward functions of ``posttrain.grpo``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    """Maps a finished sample to a scalar reward."""

    def __call__(self, sample: Sample) -> float: ...


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
