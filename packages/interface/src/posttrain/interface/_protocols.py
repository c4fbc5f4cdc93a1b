"""The Protocols that decouple packages: who produces rollouts, scores, rewards and takes weights.

A GRPO loop talks to these, never to a concrete engine or client, so a session server in front
of SGLang, a local CPU engine and a test double are interchangeable. Each is
``runtime_checkable`` and has a real implementation that a test checks with ``isinstance``:

- ``RolloutEngine``: ``posttrain.session_router.SessionRolloutClient`` (one session per rollout);
- ``TeacherScorer``: ``posttrain.opd.TeacherScoringClient``;
- ``WeightSink``: an engine in the trainer's process (grpo's loop hands it every update);
- ``RewardFunction``: the reward functions of ``posttrain.grpo``.

``RewardInput`` is what a text-level reward reads (the decoded response, the prompt, the label,
the row's metadata and the sample); it returns a finite number or ``{"reward": x, **metrics}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from posttrain.interface._samples import Sample, TeacherScores


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
    """Takes every weight update in the trainer's process (engines elsewhere take SGLang's
    routes). ``tensors`` by name: with ``lora_name`` None every weight the update carries, in
    the HF checkpoint layout; else the PEFT adapter ``lora_name`` (its ``adapter_config.json``
    dict in ``lora_config``). Raising refuses the update: the sink keeps what it served, and
    the run stops with an error naming it.
    """

    def update_weights(
        self,
        tensors: Mapping[str, Any],
        *,
        weight_version: int,
        lora_name: str | None = None,
        lora_config: Mapping[str, Any] | None = None,
    ) -> None: ...
