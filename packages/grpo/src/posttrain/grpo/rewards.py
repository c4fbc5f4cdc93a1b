"""Tasks: the prompts a run draws from and the verifiable reward that scores each sample.

A ``Task`` is a fixed list of ``Prompt``s (chat messages plus what the reward needs to know,
kept in ``metadata``) and a ``RewardFunction`` (the interface Protocol: a finished ``Sample``
in, a float out). The loop only sees those two, so a user's own task plugs in the same way.

The embedded recipe's task is ``addition``: "a+b=" with single digits and a single-digit sum
(55 prompts); the reward is 1.0 when the response text is exactly the sum, else 0.0. It is
small enough that a 4-layer model learns the format in a short supervised warm-up (see
``recipe``), and hard enough that the warmed-up base answers only about a third correctly, so
there is something for GRPO to learn. Departure from a real math task: no parsing of free-form
answers or reasoning, the answer is the whole response.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.grpo._errors import GrpoConfigError
from posttrain.interface import RewardFunction, Sample


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """One prompt: its position in the task, the chat messages, and what the reward reads."""

    index: int
    messages: tuple[dict[str, str], ...]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """A named prompt set and the reward that scores its samples."""

    name: str
    prompts: tuple[Prompt, ...]
    reward: RewardFunction


class ExactAnswerReward:
    """1.0 when the decoded response, stripped, equals ``metadata["answer"]``; else 0.0.

    ``decode`` turns response token ids into text (the policy's tokenizer).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode

    def __call__(self, sample: Sample) -> float:
        answer = sample.metadata.get("answer")
        if not isinstance(answer, str):
            raise GrpoConfigError(
                f"sample {sample.index}: metadata['answer'] is {answer!r}; the exact-answer "
                "reward needs the prompt's expected answer there"
            )
        return 1.0 if self._decode(sample.response_ids).strip() == answer else 0.0


def addition_prompts() -> tuple[Prompt, ...]:
    """ "a+b=" for digits with a + b <= 9, in a fixed order (55 prompts)."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    return tuple(
        Prompt(
            index=i,
            messages=({"role": "user", "content": f"{a}+{b}="},),
            metadata={"answer": str(a + b)},
        )
        for i, (a, b) in enumerate(pairs)
    )


TASK_NAMES = ("addition",)


def build_task(name: str, decode: Callable[[Sequence[int]], str]) -> Task:
    """The task called ``name`` with its reward, which decodes responses with ``decode``."""
    if name == "addition":
        return Task(name=name, prompts=addition_prompts(), reward=ExactAnswerReward(decode))
    raise GrpoConfigError(f"task={name!r} is not one of {', '.join(TASK_NAMES)}")


class PromptStream:
    """Prompts in seeded shuffled epochs; ``position`` (prompts handed out) is the whole state.

    Epoch ``e`` is the task order shuffled by ``random.Random(f"{seed}/{e}")``, so a stream
    rebuilt at the same position (a resumed run) hands out exactly the same prompts.
    """

    def __init__(self, prompts: Sequence[Prompt], *, seed: int, position: int = 0) -> None:
        if not prompts:
            raise GrpoConfigError("the task has no prompts")
        self._prompts = list(prompts)
        self.seed = seed
        self.position = position

    def _epoch(self, epoch: int) -> list[Prompt]:
        order = list(self._prompts)
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def take(self, count: int) -> list[Prompt]:
        """The next ``count`` prompts (crossing epoch boundaries as needed)."""
        n = len(self._prompts)
        out: list[Prompt] = []
        while len(out) < count:
            epoch, offset = divmod(self.position, n)
            chunk = self._epoch(epoch)[offset : offset + count - len(out)]
            out.extend(chunk)
            self.position += len(chunk)
        return out
