"""``--reward``: built-ins, the user's own (module:function, file.py:function), binding by name,
sync/async/batched, weighted sums, validation, and per-sample failures."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.rewards import ExactAnswerReward, Prompt
from posttrain.grpo.scoring import Scorer, bind, load_reward, score, score_samples
from posttrain.interface import RewardInput, Sample


def _sample(ids: list[int], prompt_index: int, index: int = 0, **metadata: str) -> Sample:
    """A finished sample; ``metadata`` is what the rollout copies from its prompt."""
    return Sample(
        prompt_ids=[1, 2], response_ids=ids, rollout_logprobs=[-0.5] * len(ids),
        loss_mask=[1] * len(ids), metadata={**metadata, "prompt_index": prompt_index},
        index=index,
    )  # fmt: skip


def _decode(ids: list[int] | tuple[int, ...]) -> str:
    return "".join(chr(ord("0") + i) for i in ids)


USER_FILE = """
    import asyncio
    import math

    def right(response, label):
        return float(response.strip() == str(label))

    def with_metrics(response, label, metadata, prompt, sample):
        return {"reward": float(response == label), "length": len(sample.response_ids),
                "has_meta": float(bool(metadata)), "prompt_is_text": float(isinstance(prompt, str))}

    async def later(response):
        await asyncio.sleep(0)
        return 0.5

    def batch(responses, labels):
        return [float(r == l) for r, l in zip(responses, labels)]

    def nan(response):
        return math.nan

    def text(response):
        return "1.0"

    def raises_on_seven(response):
        if response == "7":
            raise RuntimeError("seven is unlucky")
        return 1.0

    def always_raises(response):
        raise KeyError("no")

    def bad_batch(responses):
        return [1.0]

    def odd(x, y):
        return 1.0
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def _inputs(responses: list[str], labels: list[str]) -> list[RewardInput]:
    return [
        RewardInput(response=r, prompt="q", label=lab, metadata={"k": 1}, sample=_sample([1], 0))
        for r, lab in zip(responses, labels, strict=True)
    ]


def test_builtins_by_name() -> None:
    xs = _inputs(["3", " 3 ", "three"], ["3", "3", "3"])
    assert [s.reward for s in score([load_reward("exact")], xs)] == [1.0, 1.0, 0.0]
    assert [s.reward for s in score([load_reward(r"regex=^\d+$")], xs)] == [1.0, 0.0, 0.0]
    long = RewardInput(response="", prompt="q", sample=_sample([1, 2, 3], 0))
    assert score([load_reward("length", max_new_tokens=4)], [long])[0].reward == 0.25


def test_weights_combine_and_log_each_part() -> None:
    scorer = Scorer.from_specs(["exact:0.9", "length:0.1"], max_new_tokens=2)
    (s,) = scorer.score(_inputs(["3"], ["3"]))
    assert s.reward == pytest.approx(0.9 + 0.1 * 0.5)
    assert s.metrics == {"reward/exact": 1.0, "reward/length": 0.5}


def test_user_rewards_from_a_file_and_a_module(
    user_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xs = _inputs(["3", "4"], ["3", "3"])
    assert [s.reward for s in score([load_reward(f"{user_file}:right")], xs)] == [1.0, 0.0]
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert [s.reward for s in score([load_reward("my_reward:batch")], xs)] == [1.0, 0.0]
    assert [s.reward for s in score([load_reward("my_reward:later")], xs)] == [0.5, 0.5]
    (s, _) = score([load_reward(f"{user_file}:with_metrics")], xs)
    assert s.reward == 1.0
    assert s.metrics == {
        "reward/length": 1.0, "reward/has_meta": 1.0, "reward/prompt_is_text": 1.0
    }  # fmt: skip


def test_bad_returns_and_raises_fail_single_samples(user_file: Path) -> None:
    xs = _inputs(["3", "7"], ["3", "3"])
    for name, reason in [
        ("nan", "not_finite"),
        ("text", "not_a_number"),
        ("bad_batch", "wrong_length"),
    ]:
        results = score([load_reward(f"{user_file}:{name}")], xs)
        assert all(r.reward is None and r.failure is not None for r in results), name
        assert results[0].failure is not None
        assert results[0].failure.reason == reason
    ok, failed = score([load_reward(f"{user_file}:raises_on_seven")], xs)
    assert ok.reward == 1.0
    assert failed.reward is None
    assert failed.failure is not None
    assert failed.failure.reason == "RuntimeError"
    assert "seven is unlucky" in str(failed.failure)


def test_refused_specs_name_the_problem(user_file: Path) -> None:
    cases = {
        "nope": "not a built-in",
        "no_such_module_xyz:f": "cannot import no_such_module_xyz: ModuleNotFoundError",
        f"{user_file.parent}/missing.py:f": "missing.py does not exist",
        f"{user_file}:absent": "has no 'absent'",
        f"{user_file}:odd": "parameter 'x' is not one a reward is given",
        "regex=(": "is not a regular expression",
        "exact:1e999": "weight 1e999 is not finite",
    }
    for spec, needle in cases.items():
        with pytest.raises(GrpoConfigError) as err:
            load_reward(spec)
        assert needle in str(err.value), spec
        assert "\n" not in str(err.value)


def test_binding_refuses_mixed_and_empty_signatures() -> None:
    with pytest.raises(GrpoConfigError, match="mixes per-sample"):
        bind(lambda response, labels: 1.0, name="mixed")
    with pytest.raises(GrpoConfigError, match="would not see the sample"):
        bind(lambda: 1.0, name="empty")


def test_score_samples_keeps_legacy_rewards_and_counts_failures(user_file: Path) -> None:
    prompts = {
        0: Prompt(index=0, messages=({"role": "user", "content": "1+2="},), label="3",
                  metadata={"answer": "3"}),
        1: Prompt(index=1, text="3+4=", label="7", row_metadata={"src": "t"}),
    }  # fmt: skip
    samples = [_sample([3], 0, 0, answer="3"), _sample([7], 1, 1), _sample([3], 0, 2, answer="3")]
    legacy = score_samples(ExactAnswerReward(_decode), samples, prompts, _decode)
    assert [s.reward for s in legacy.kept] == [1.0, 1.0]  # sample 1 has no "answer"
    assert [s.index for s, _ in legacy.failed] == [1]
    assert legacy.metrics["reward_failed_samples"] == 1.0
    assert legacy.metrics["reward_failed/GrpoConfigError"] == 1.0
    user = score_samples(
        Scorer.from_specs([f"{user_file}:raises_on_seven"]), samples, prompts, _decode
    )
    assert [s.index for s in user.kept] == [0, 2]
    assert user.metrics["reward_failed/RuntimeError"] == 1.0
    assert not any(math.isnan(v) for v in user.metrics.values())


def test_a_protocol_reward_with_its_own_parameter_name_still_binds() -> None:
    """Today's ``RewardFunction`` callers: ``__call__(self, s)`` gets the sample."""

    class Legacy:
        def __call__(self, s: Sample) -> float:
            return float(len(s.response_ids))

    prompts = {0: Prompt(index=0, messages=({"role": "user", "content": "q"},))}
    scored = score_samples(Legacy(), [_sample([1, 2], 0)], prompts, _decode)
    assert [s.reward for s in scored.kept] == [2.0]
    with pytest.raises(GrpoConfigError, match="parameter 'x' is not one"):
        score_samples(lambda x, y: 1.0, [_sample([1], 0)], prompts, _decode)
