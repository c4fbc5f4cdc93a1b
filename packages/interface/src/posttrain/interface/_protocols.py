"""The Protocols that decouple packages: who produces rollouts, scores, rewards and takes weights.

A GRPO loop talks to these, never to a concrete engine or client, so a
local CPU engine, an SGLang server behind sgl-router and a test double are
interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from posttrain.interface._samples import Sample, TeacherScores
from posttrain.interface._weight_sync import BucketManifest, WeightUpdateBegin, WeightUpdateResult
from posttrain.interface._wire_sglang import GenerateRequest, GenerateResponse


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that answers SGLang ``/generate`` requests (an engine, a router, a session)."""

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        """One response per prompt of the request, in order."""
        ...


@runtime_checkable
class TeacherScorer(Protocol):
    """Scores the response tokens of student samples with a teacher model."""

    async def score_batch(self, samples: Sequence[Sample]) -> list[TeacherScores]:
        """One ``TeacherScores`` per sample, in input order."""
        ...


@runtime_checkable
class RewardFunction(Protocol):
    """Maps a finished sample to a scalar reward."""

    def __call__(self, sample: Sample) -> float: ...


@runtime_checkable
class WeightSink(Protocol):
    """Receives a weight update (``wsync/1``): begin, buckets, end; or abort."""

    def begin(self, header: WeightUpdateBegin) -> None: ...

    def send_bucket(self, manifest: BucketManifest, payload: bytes | memoryview) -> None: ...

    def end(self, update_id: str) -> WeightUpdateResult: ...

    def abort(self, update_id: str) -> None: ...
