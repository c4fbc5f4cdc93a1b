"""The multimodal ``shapes`` task: its prompts, images and answers, and where it is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.grpo import GrpoConfigError, GrpoRunError
from posttrain.grpo.recipe import RECIPES, model_config, prepare
from posttrain.grpo.rewards import (
    SHAPE_COLORS,
    ExactAnswerReward,
    build_task,
    shapes_prompts,
)
from posttrain.grpo.rollout import RolloutSettings, run_rollout
from posttrain.interface import MediaKind, Sample
from posttrain.models import build_tokenizer, decode_image


def test_prompts_are_fixed_and_their_answers_are_what_the_image_shows() -> None:
    prompts = shapes_prompts()
    assert prompts == shapes_prompts()  # no randomness: the same images, byte for byte
    assert len(prompts) == 3 * 15 * 2
    assert [p.index for p in prompts] == list(range(90))
    initials = {rgb: initial for initial, rgb in SHAPE_COLORS.items()}
    for p in prompts:
        (media,) = p.media
        assert media.kind is MediaKind.IMAGE
        assert media.ref.startswith("data:image/png;base64,")
        pixels = decode_image(media.ref).data
        assert pixels.shape == (8, 8, 3)
        cells = pixels.reshape(2, 4, 2, 4, 3).permute(0, 2, 1, 3, 4).reshape(4, 16, 3)
        lit = [c for c in range(4) if bool(cells[c].any())]
        for c in lit:  # every lit cell is one flat colour, the same in all of them
            assert torch.equal(cells[c], cells[lit[0]][0].expand(16, 3))
        content = p.messages[0]["content"]
        assert content.startswith("<|image|>")
        if content.endswith("count:"):
            assert p.metadata["answer"] == str(len(lit))
        else:
            assert content.endswith("color:")
            assert p.metadata["answer"] == initials[tuple(cells[lit[0]][0].tolist())]


def test_the_sentinel_is_one_token_and_the_reward_is_exact() -> None:
    tok = build_tokenizer(multimodal=True)
    ids = tok.encode(shapes_prompts()[0].messages[0]["content"], add_special_tokens=False)
    assert ids[0] == model_config("shapes").image_token_id
    assert ids.count(ids[0]) == 1
    task = build_task("shapes", lambda got: tok.decode(got, skip_special_tokens=True))
    reward = task.reward
    assert isinstance(reward, ExactAnswerReward)
    answer = tok.encode("3", add_special_tokens=False)
    right = Sample(prompt_ids=[1], response_ids=answer, rollout_logprobs=[-0.1],
                   loss_mask=[1], metadata={"answer": "3"})  # fmt: skip
    wrong = Sample(prompt_ids=[1], response_ids=answer, rollout_logprobs=[-0.1],
                   loss_mask=[1], metadata={"answer": "2"})  # fmt: skip
    assert (reward(right), reward(wrong)) == (1.0, 0.0)


def test_unknown_tasks_and_unsupported_recipes_are_named(tmp_path: Path) -> None:
    with pytest.raises(GrpoConfigError, match="task='boxes' is not one of addition, shapes"):
        build_task("boxes", str)
    with pytest.raises(GrpoConfigError, match="task='boxes' has no embedded recipe"):
        prepare(tmp_path, 0, task="boxes")
    with pytest.raises(GrpoConfigError, match="the shapes recipe has no NVFP4 copy"):
        prepare(tmp_path, 0, task="shapes", nvfp4=True)
    assert RECIPES["shapes"]["max_new_tokens"] == 2  # one character and the end token
    assert not any(tmp_path.iterdir())  # nothing written


class _TextOnlyEngine:
    async def rollout(self, messages: Any, *, sampling_params: Any = None,
                      weight_version: int | None = None) -> Sample:  # fmt: skip
        raise AssertionError("never called: the prompts carry images")


def test_a_protocol_engine_cannot_take_image_prompts() -> None:
    settings = RolloutSettings(url="http://unused", samples_per_prompt=1, max_new_tokens=2,
                               temperature=1.0, seed=0)  # fmt: skip
    with pytest.raises(GrpoRunError, match="takes no media; a multimodal task rolls out"):
        run_rollout(settings, shapes_prompts()[:2], step=0, engine=_TextOnlyEngine())
