"""The toy task, its verifiable reward, and the resumable prompt stream."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.grpo import GrpoConfigError
from posttrain.grpo.rewards import ExactAnswerReward, PromptStream, addition_prompts, build_task
from posttrain.interface import RewardFunction, Sample


def _decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_addition_prompts_and_reward() -> None:
    prompts = addition_prompts()
    assert len(prompts) == 55
    assert [p.index for p in prompts] == list(range(55))
    for p in prompts:
        a, b = p.messages[0]["content"].removesuffix("=").split("+")
        assert int(a) + int(b) == int(p.metadata["answer"]) <= 9
    task = build_task("addition", _decode)
    assert isinstance(task.reward, RewardFunction)

    def sample(text: str, answer: object = "7") -> Sample:
        return Sample(prompt_ids=[1], response_ids=[ord(c) for c in text],
                      rollout_logprobs=[0.0] * len(text), loss_mask=[1] * len(text),
                      metadata={"answer": answer})  # fmt: skip

    assert task.reward(sample("7")) == 1.0
    assert task.reward(sample(" 7\n")) == 1.0
    assert task.reward(sample("77")) == 0.0
    assert task.reward(sample("")) == 0.0
    with pytest.raises(GrpoConfigError, match=r"metadata\['answer'\] is None"):
        ExactAnswerReward(_decode)(sample("7", answer=None))
    with pytest.raises(GrpoConfigError, match="task='gsm8k' is not one of addition"):
        build_task("gsm8k", _decode)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 1000),
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8),
)
def test_prompt_stream_is_resumable_at_any_position(seed: int, chunks: list[int]) -> None:
    prompts = addition_prompts()
    whole = PromptStream(prompts, seed=seed).take(sum(chunks))
    stream = PromptStream(prompts, seed=seed)
    got = []
    for n in chunks:
        resumed = PromptStream(prompts, seed=seed, position=stream.position)
        part = resumed.take(n)
        assert part == stream.take(n)
        got += part
    assert got == whole
    first_epoch = PromptStream(prompts, seed=seed).take(55)
    assert sorted(p.index for p in first_epoch) == list(range(55))  # an epoch is a permutation


def test_prompt_stream_needs_prompts() -> None:
    with pytest.raises(GrpoConfigError, match="no prompts"):
        PromptStream([], seed=0)
