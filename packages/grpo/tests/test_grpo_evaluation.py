"""Evaluation: greedy (temperature 0) with one sample per prompt, sampled with k; reward mean
and pass@k per set; when it runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.data import build_prompts
from posttrain.grpo.evaluation import due, evaluate
from posttrain.grpo.scoring import Scorer
from posttrain.interface import RolloutEngine, Sample


class AnswerEngine:
    """Answers ``a+b=`` with ``a+b`` on the sample whose seed is even, else with 0; records the
    sampling fields it was given."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []

    async def rollout(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        weight_version: int | None = None,
    ) -> Sample:
        params = dict(sampling_params or {})
        self.params.append(params)
        a, b = (int(x) for x in str(messages[-1]["content"]).rstrip("=").split("+"))
        right = params["temperature"] == 0.0 or params["seed"] % 2 == 0
        answer = str(a + b) if right else "0"
        ids = [ord(c) for c in answer]
        return Sample(prompt_ids=[1], response_ids=ids, rollout_logprobs=[-0.1] * len(ids),
                      loss_mask=[1] * len(ids))  # fmt: skip


def _decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


ROWS = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(1, 6)]


def test_greedy_and_sampled_evaluation() -> None:
    prompts = build_prompts(ROWS, input_key="prompt", label_key="label")
    engine = AnswerEngine()
    assert isinstance(engine, RolloutEngine)
    scorer = Scorer.from_specs(["exact"])
    greedy = evaluate(
        GrpoConfig(eval_data=("x",)), {"dev": prompts}, scorer, _decode, step=0, version=1,
        api_key=None, engine=engine,
    )  # fmt: skip
    assert greedy == {"eval/dev/reward_mean": 1.0, "eval/dev/pass@1": 1.0}
    assert {p["temperature"] for p in engine.params} == {0.0}
    engine.params.clear()
    cfg = GrpoConfig(eval_data=("x",), eval_samples_per_prompt=4, temperature=0.7)
    sampled = evaluate(cfg, {"dev": prompts}, scorer, _decode, step=3, version=2,
                       api_key=None, engine=engine)  # fmt: skip
    assert {p["temperature"] for p in engine.params} == {0.7}
    seeds = [p["seed"] for p in engine.params]
    assert len(seeds) == 20
    right = [s % 2 == 0 for s in seeds]
    assert sampled["eval/dev/reward_mean"] == sum(right) / 20
    per_prompt = [any(right[i * 4 : (i + 1) * 4]) for i in range(5)]
    assert sampled["eval/dev/pass@4"] == sum(per_prompt) / 5
    # the same step evaluates the same samples (seeded); another step others
    again = AnswerEngine()
    evaluate(cfg, {"dev": prompts}, scorer, _decode, step=3, version=2, api_key=None,
             engine=again)  # fmt: skip
    assert [p["seed"] for p in again.params] == seeds


def test_when_evaluation_runs() -> None:
    cfg = GrpoConfig(steps=7, eval_data=("x",), eval_every=3)
    assert [s for s in range(7) if due(cfg, s)] == [2, 5, 6]
    assert [s for s in range(7) if due(GrpoConfig(steps=7, eval_data=("x",)), s)] == [6]
    assert not any(due(GrpoConfig(steps=7, eval_every=3), s) for s in range(7))
