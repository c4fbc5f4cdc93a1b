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

The multimodal toy task is ``shapes``: an 8x8 image (a 2x2 grid of 4x4 cells, one vision patch
each) with 1 to 4 filled squares of one colour (red, green or blue) on black; the prompt is the
image sentinel followed by ``count:`` or ``color:``, and the answer one character, the number of
squares or the colour's initial (``r``, ``g``, ``b``), scored by the same exact-answer reward.
Every colour, every non-empty set of cells and both questions make its 90 prompts; the images
are PNGs built from a fixed pattern (no randomness), sent as ``data:`` URL references, so a
run's prompts depend only on its seed's shuffle (``PromptStream``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.grpo._errors import GrpoConfigError
from posttrain.interface import MediaKind, MediaRef, Sample


@dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """One prompt: its position in the task, the chat messages, and what the reward reads;
    ``media`` are the images and audio its sentinels stand for (sent as ``image_data`` /
    ``audio_data``).

    ``text`` (instead of ``messages``) is a raw text prompt, sent without a chat template (the
    session router's completions path, for base models). ``label`` and ``row_metadata`` are
    what a ``--prompt-data`` row gives the reward (``RewardInput.label`` / ``.metadata``);
    ``metadata`` travels with the rollout on the sample.
    """

    index: int
    messages: tuple[dict[str, str], ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    media: tuple[MediaRef, ...] = ()
    text: str | None = None
    label: Any = None
    row_metadata: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    """A named prompt set and the reward that scores its samples.

    ``reward``: a ``RewardFunction`` (parameters bound by name, ``posttrain.grpo.scoring``) or
    a ``scoring.Scorer`` (what ``--reward`` builds).
    """

    name: str
    prompts: tuple[Prompt, ...]
    reward: Any  # RewardFunction | scoring.Scorer


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
            label=str(a + b),
        )
        for i, (a, b) in enumerate(pairs)
    )


SHAPE_COLORS: dict[str, tuple[int, int, int]] = {
    "r": (255, 0, 0),
    "g": (0, 255, 0),
    "b": (0, 0, 255),
}
SHAPE_CELL = 4  # pixels per grid cell: one vision patch of ``ModelConfig.multimodal_tiny``
SHAPE_GRID = 2  # cells per side


def shapes_image(color: tuple[int, int, int], cells: Sequence[int]) -> Any:
    """The ``[8, 8, 3]`` uint8 image with the grid ``cells`` (row-major) filled in ``color``."""
    import torch

    side = SHAPE_CELL * SHAPE_GRID
    image = torch.zeros(side, side, 3, dtype=torch.uint8)
    for cell in cells:
        row, col = divmod(cell, SHAPE_GRID)
        image[
            row * SHAPE_CELL : (row + 1) * SHAPE_CELL, col * SHAPE_CELL : (col + 1) * SHAPE_CELL
        ] = torch.tensor(color, dtype=torch.uint8)
    return image


def shapes_prompts() -> tuple[Prompt, ...]:
    """The ``shapes`` task: every colour x non-empty cell set x question, in a fixed order."""
    from posttrain.models import MEDIA_TOKENS, encode_png_base64

    image_sentinel = MEDIA_TOKENS[0]

    cell_sets = [
        [c for c in range(SHAPE_GRID * SHAPE_GRID) if mask >> c & 1]
        for mask in range(1, 1 << (SHAPE_GRID * SHAPE_GRID))
    ]
    prompts: list[Prompt] = []
    for initial, color in SHAPE_COLORS.items():
        for cells in cell_sets:
            ref = "data:image/png;base64," + encode_png_base64(shapes_image(color, cells))
            for question, answer in (("count:", str(len(cells))), ("color:", initial)):
                prompts.append(
                    Prompt(
                        index=len(prompts),
                        messages=({"role": "user", "content": image_sentinel + question},),
                        metadata={"answer": answer},
                        label=answer,
                        media=(MediaRef(kind=MediaKind.IMAGE, ref=ref),),
                    )
                )
    return tuple(prompts)


TASK_NAMES = ("addition", "shapes")
MULTIMODAL_TASKS = frozenset({"shapes"})


def build_task(name: str, decode: Callable[[Sequence[int]], str]) -> Task:
    """The task called ``name`` with its reward, which decodes responses with ``decode``."""
    if name == "addition":
        return Task(name=name, prompts=addition_prompts(), reward=ExactAnswerReward(decode))
    if name == "shapes":
        return Task(name=name, prompts=shapes_prompts(), reward=ExactAnswerReward(decode))
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
