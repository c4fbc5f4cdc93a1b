"""The RL data model: samples (trajectories), sample groups and sparse teacher scores.

These are plain dataclasses validated on construction, so a malformed sample
fails where it is built, with the field named, instead of deep inside a loss.
Token ids and logprobs are Python lists, not tensors: the interface imports no
torch, and every package converts at its own boundary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from posttrain.interface._errors import ConfigError
from posttrain.interface._media import MediaRef
from posttrain.interface._weight_version import is_weight_version

# Sample metadata keys one package writes and another reads: each spelled once, here, so a
# rename is a type-checked change on both sides instead of a filter that silently stops.
WEIGHT_VERSIONS_KEY: Final = "weight_versions"
"""``metadata[WEIGHT_VERSIONS_KEY]``: the engine weight version of each turn of a sample
(``list[int | None]``, ``None`` for a turn whose engine reported none). The session router writes
it when it assembles a session's turns; grpo's stale-sample filter reads it (a sample with any
turn from other weights than the trainer's is stale)."""
SESSION_ID_KEY: Final = "session_id"
"""``metadata[SESSION_ID_KEY]``: the id of the session-router session that drew the sample
(written by its rollout client, named in the trainer's reports of dropped samples)."""
ABORT_REASON_KEY: Final = "abort_reason"
"""``metadata[ABORT_REASON_KEY]``: why a rollout was aborted (a ``SampleStatus.ABORTED`` sample
with no tokens; written by the session router's rollout client, reported by the trainer)."""


class SampleStatus(StrEnum):
    """How a rollout ended: the engine stopped it, it hit a length cap, or it was aborted."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


def _check_token_ids(name: str, ids: Sequence[int]) -> None:
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(f"{name}[{position}] must be a non-negative int, got {token!r}")


def _check_finite(name: str, values: Sequence[float]) -> None:
    for position, value in enumerate(values):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigError(f"{name}[{position}] must be a finite float, got {value!r}")


@dataclass(kw_only=True, slots=True)
class Sample:
    """One trajectory: prompt and response token ids plus what training needs about them.

    ``rollout_logprobs[t]`` is the engine's logprob of ``response_ids[t]``;
    ``loss_mask[t]`` is 1 where the token is trained on (0 for tool or
    observation tokens inside a multi-turn response). ``weight_version`` is the
    version of the weights that generated it (an int, see ``parse_weight_version``).
    ``media`` lists the prompt's image and audio items as the engine got them (``MediaRef``,
    in sentinel order per kind); empty for a text-only sample.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    reward: float | None = None
    status: SampleStatus = SampleStatus.COMPLETED
    weight_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    group_index: int | None = None
    index: int | None = None
    media: list[MediaRef] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.media, list | tuple):
            raise ConfigError(f"media must be a list, got {type(self.media).__name__}")
        self.media = [MediaRef.from_dict(m, where=f"media[{i}]") for i, m in enumerate(self.media)]
        self.prompt_ids = list(self.prompt_ids)
        self.response_ids = list(self.response_ids)
        self.rollout_logprobs = [
            float(v) if isinstance(v, int) and not isinstance(v, bool) else v
            for v in self.rollout_logprobs
        ]
        self.loss_mask = list(self.loss_mask)
        _check_token_ids("prompt_ids", self.prompt_ids)
        _check_token_ids("response_ids", self.response_ids)
        _check_finite("rollout_logprobs", self.rollout_logprobs)
        response_length = len(self.response_ids)
        if len(self.rollout_logprobs) != response_length:
            raise ConfigError(
                f"rollout_logprobs has {len(self.rollout_logprobs)} entries but response_ids has "
                f"{response_length}"
            )
        if len(self.loss_mask) != response_length:
            raise ConfigError(
                f"loss_mask has {len(self.loss_mask)} entries but response_ids has {response_length}"
            )
        for position, bit in enumerate(self.loss_mask):
            if bit not in (0, 1) or isinstance(bit, bool):
                raise ConfigError(f"loss_mask[{position}] must be 0 or 1, got {bit!r}")
        if self.weight_version is not None and not is_weight_version(self.weight_version):
            raise ConfigError(
                f"weight_version must be a non-negative int or None, got {self.weight_version!r}"
            )
        if self.reward is not None:
            _check_finite("reward", [self.reward])
            self.reward = float(self.reward)
        try:
            self.status = SampleStatus(self.status)
        except ValueError:
            allowed = ", ".join(s.value for s in SampleStatus)
            raise ConfigError(f"status must be one of {allowed}, got {self.status!r}") from None
        if not isinstance(self.metadata, dict):
            raise ConfigError(f"metadata must be a dict, got {type(self.metadata).__name__}")

    @property
    def tokens(self) -> list[int]:
        """Prompt followed by response: the sequence the trainer recomputes logprobs over."""
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``Sample.from_dict(s.to_dict()) == s``."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "rollout_logprobs": list(self.rollout_logprobs),
            "loss_mask": list(self.loss_mask),
            "reward": self.reward,
            "status": self.status.value,
            "weight_version": self.weight_version,
            "metadata": dict(self.metadata),
            "group_index": self.group_index,
            "index": self.index,
            "media": [m.to_dict() for m in self.media],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown Sample field(s): {', '.join(unknown)}")
        return cls(**dict(data))


@dataclass(kw_only=True, slots=True)
class SampleGroup:
    """The n samples drawn for one prompt; group-normalised advantages are computed within it."""

    group_index: int
    samples: list[Sample]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ConfigError(f"SampleGroup {self.group_index} has no samples")
        for position, sample in enumerate(self.samples):
            if sample.prompt_ids != self.samples[0].prompt_ids:
                raise ConfigError(
                    f"SampleGroup {self.group_index}: samples[{position}] has a different prompt"
                )

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def rewards(self) -> list[float]:
        """Every sample's reward; raises if one is still unscored."""
        out: list[float] = []
        for position, sample in enumerate(self.samples):
            if sample.reward is None:
                raise ConfigError(
                    f"SampleGroup {self.group_index}: samples[{position}] has no reward"
                )
            out.append(sample.reward)
        return out


@dataclass(kw_only=True, slots=True, frozen=True)
class PositionScores:
    """A teacher's logprobs for a few token ids at one response position (sparse top-k)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "logprobs", tuple(float(v) for v in self.logprobs))
        if len(self.token_ids) != len(self.logprobs):
            raise ConfigError(
                f"PositionScores has {len(self.token_ids)} token_ids but {len(self.logprobs)} logprobs"
            )
        if len(set(self.token_ids)) != len(self.token_ids):
            raise ConfigError(f"PositionScores token_ids repeat an id: {list(self.token_ids)}")
        _check_token_ids("token_ids", self.token_ids)
        _check_finite("logprobs", self.logprobs)

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.token_ids, self.logprobs, strict=True))


@dataclass(kw_only=True, slots=True, frozen=True)
class TeacherScores:
    """A teacher's view of one sample's response: one entry per response position.

    ``sampled_logprobs[t]`` is the teacher's logprob of the sampled token at
    response position t (None when not requested); ``positions[t]`` holds the
    sparse top-k scores (empty when k = 0).
    """

    teacher_name: str
    sampled_logprobs: tuple[float, ...] | None = None
    positions: tuple[PositionScores, ...] = ()

    def __post_init__(self) -> None:
        if not self.teacher_name:
            raise ConfigError("TeacherScores.teacher_name must be non-empty")
        if self.sampled_logprobs is not None:
            object.__setattr__(
                self, "sampled_logprobs", tuple(float(v) for v in self.sampled_logprobs)
            )
            _check_finite("sampled_logprobs", self.sampled_logprobs)
        object.__setattr__(self, "positions", tuple(self.positions))
        if (
            self.sampled_logprobs is not None
            and self.positions
            and len(self.positions) != len(self.sampled_logprobs)
        ):
            raise ConfigError(
                f"TeacherScores has {len(self.sampled_logprobs)} sampled_logprobs but "
                f"{len(self.positions)} positions"
            )

    @property
    def response_length(self) -> int:
        if self.sampled_logprobs is not None:
            return len(self.sampled_logprobs)
        return len(self.positions)
