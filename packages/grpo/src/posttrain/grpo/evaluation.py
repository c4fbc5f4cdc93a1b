"""Evaluation on held-out prompt sets: ``--eval-data``, ``--eval-every``, ``--eval-samples-per-prompt``.

Every ``eval_every`` steps (and after the last step) rank 0 rolls out each eval set with the
weights the engines now serve: one greedy sample per prompt (temperature 0) when
``eval_samples_per_prompt`` is 1, else k samples at the run's temperature. The samples are
scored by the run's reward (a sample whose reward fails scores 0) and logged per set as

* ``eval/<set>/reward_mean``: the mean reward over every sample;
* ``eval/<set>/pass@k``: the fraction of prompts with at least one of its k samples passing
  (reward >= ``PASS_THRESHOLD``; for binary rewards such as ``math`` and ``exact``: right).

With k samples drawn per prompt this is the unbiased pass@k estimator at n = k. The sampling
seeds are those of the training rollouts at a step no training rollout uses (``-1 - step``), so
an eval is reproducible and a resumed run evaluates the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.grpo.config import GrpoConfig
from posttrain.grpo.rewards import Prompt
from posttrain.grpo.rollout import RolloutSettings, run_rollout
from posttrain.grpo.scoring import score_samples
from posttrain.interface import RolloutEngine, SampleStatus

PASS_THRESHOLD = 0.5


def due(cfg: GrpoConfig, step: int) -> bool:
    """Whether the run evaluates after ``step``."""
    if not cfg.eval_data:
        return False
    last = step == cfg.steps - 1
    return last or bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0)


def evaluate(
    cfg: GrpoConfig,
    sets: Mapping[str, Sequence[Prompt]],
    reward: Any,
    decode: Callable[[Sequence[int]], str],
    *,
    step: int,
    version: int,
    api_key: str | None,
    engine: RolloutEngine | None = None,
) -> dict[str, float]:
    """The eval metrics of every set after ``step`` (see the module docstring)."""
    k = cfg.eval_samples_per_prompt
    settings = RolloutSettings(
        url=str(cfg.rollout_url or ""),
        samples_per_prompt=k,
        max_new_tokens=cfg.max_new_tokens,
        temperature=0.0 if k == 1 else cfg.temperature,
        seed=cfg.seed,
        weight_version=version,
        timeout_s=cfg.rollout_timeout_s,
        turn_timeout_s=min(cfg.turn_timeout_s, cfg.rollout_timeout_s),
        api_key=api_key,
    )
    metrics: dict[str, float] = {}
    for name, prompts in sets.items():
        samples = run_rollout(settings, prompts, step=-1 - step, engine=engine)
        done = [s for s in samples if s.status is not SampleStatus.ABORTED]
        scored = score_samples(reward, done, {p.index: p for p in prompts}, decode)
        kept = {id(s) for s in scored.kept}
        rewards: dict[int, list[float]] = {p.index: [] for p in prompts}
        for s in samples:  # aborted and failed samples score 0
            value = s.reward if id(s) in kept and s.reward is not None else 0.0
            group = prompts[int(s.group_index or 0)].index
            rewards[group].append(float(value))
        every = [r for values in rewards.values() for r in values]
        metrics[f"eval/{name}/reward_mean"] = sum(every) / max(len(every), 1)
        passed = sum(any(r >= PASS_THRESHOLD for r in values) for values in rewards.values())
        metrics[f"eval/{name}/pass@{k}"] = passed / max(len(rewards), 1)
    return metrics
