"""Rewards from the command line: built-ins by name, the user's own functions, weighted sums.

``--reward SPEC`` (repeatable; several combine as a weighted sum) where SPEC is one of

* ``math``: the final answer (``\\boxed{}`` or the last expression, as ``math-verify``
  extracts it) is equivalent to the label (``math_verify.verify``: numbers, fractions, LaTeX,
  sets, units stripped); 1.0 or 0.0;
* ``exact``: the response, stripped, equals ``str(label)``, stripped; 1.0 or 0.0;
* ``regex=PATTERN``: 1.0 when ``re.search(PATTERN, response)`` matches (a format reward);
* ``length``: ``1 - response_tokens / max_new_tokens`` (shorter is better; pair it with a
  small weight);
* ``package.module:function`` or ``path/to/file.py:function``: the user's own;

each optionally followed by ``:WEIGHT`` (a number; default 1.0), e.g. ``--reward math:0.9
--reward length:0.1``.

A reward's parameters are bound by name (``posttrain.interface.RewardFunction``): ``response``,
``prompt``, ``label``, ``metadata``, ``sample``, ``input`` (a ``RewardInput``) for one sample
per call, or the plurals ``responses``, ``prompts``, ``labels``, ``metadatas``, ``samples``,
``inputs`` for a whole step in one call (returning one result per sample). It may be
``async``. Its result is validated: a finite number, or a dict with a finite ``reward`` and
other finite numbers, logged as ``reward/<key>`` means.

A reward that raises, or returns something else, fails that sample (left out of the step, like
an aborted one): ``reward_failed_samples`` counts them and ``reward_failed/<reason>`` counts each
reason (the exception type, ``not_finite``, ``not_a_number``), and a warning names the sample and
the message. A step all of whose samples fail is an error.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.grpo._errors import GrpoConfigError, GrpoError
from posttrain.grpo.rewards import Prompt
from posttrain.interface import RewardInput, Sample

SINGLE = ("response", "prompt", "label", "metadata", "sample", "input")
BATCH = ("responses", "prompts", "labels", "metadatas", "samples", "inputs")
BUILTINS = ("math", "exact", "regex=PATTERN", "length")
_WEIGHT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_CONCURRENCY = 32  # async per-sample rewards in flight at once


class RewardSampleError(GrpoError):
    """One sample's reward failed; ``reason`` is the short counted kind."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------- built-ins


def math_reward(response: str, label: Any) -> float:
    """1.0 when ``math-verify`` finds the response's final answer equivalent to ``label``."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_label_text(label), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"label {label!r} holds no answer math-verify can parse")
    answer = parse(response, parsing_timeout=timeout)
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


def _label_text(label: Any) -> str:
    if label is None or isinstance(label, bool) or not isinstance(label, str | int | float):
        raise ValueError(f"label {label!r} is not a text or a number")
    text = str(label)
    # A bare label is the answer itself: wrap it so LaTeX like "\frac{1}{2}" parses as math.
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def exact_reward(response: str, label: Any) -> float:
    """1.0 when the stripped response equals ``str(label)`` stripped."""
    if label is None:
        raise ValueError("the exact reward needs a label (--label-key)")
    return 1.0 if response.strip() == str(label).strip() else 0.0


def regex_reward(pattern: str) -> Callable[[str], float]:
    """1.0 when ``pattern`` is found in the response."""
    compiled = re.compile(pattern)

    def regex(response: str) -> float:
        return 1.0 if compiled.search(response) else 0.0

    return regex


def length_reward(max_new_tokens: int) -> Callable[..., float]:
    """``1 - response_tokens / max_new_tokens``, at least 0."""

    def length(sample: Any) -> float:
        tokens = len(sample.response_ids) if sample is not None else 0
        return max(0.0, 1.0 - tokens / max_new_tokens)

    return length


# --------------------------------------------------------------------------- binding


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundReward:
    """One reward with its parameters resolved: which names it reads, batched or not."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    params: tuple[str, ...] = ()
    batched: bool = False
    positional_sample: bool = False  # the Protocol's form, ``f(sample)``, whatever its name


def bind(fn: Any, *, name: str, weight: float = 1.0) -> BoundReward:
    """Resolve ``fn``'s parameters by name; a ``GrpoConfigError`` names what cannot bind."""
    if not callable(fn):
        raise GrpoConfigError(f"reward {name!r} is a {type(fn).__name__}, not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise GrpoConfigError(f"reward {name!r}: its signature cannot be read: {exc}") from exc
    params: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in SINGLE or p.name in BATCH:
            params.append(p.name)
        elif p.default is p.empty:
            raise GrpoConfigError(
                f"reward {name!r}: parameter {p.name!r} is not one a reward is given (one of "
                f"{', '.join(SINGLE)}, or for a batch {', '.join(BATCH)})"
            )
    if not params:
        raise GrpoConfigError(
            f"reward {name!r} takes none of {', '.join(SINGLE)} (or {', '.join(BATCH)}): "
            "it would not see the sample"
        )
    single = [p for p in params if p in SINGLE]
    batch = [p for p in params if p in BATCH]
    if single and batch:
        raise GrpoConfigError(
            f"reward {name!r} mixes per-sample ({', '.join(single)}) and batch "
            f"({', '.join(batch)}) parameters; use one kind"
        )
    return BoundReward(name=name, fn=fn, weight=weight, params=tuple(params), batched=bool(batch))


def _parse_weight(spec: str) -> tuple[str, float]:
    head, sep, tail = spec.rpartition(":")
    if sep and head and _WEIGHT.match(tail):
        weight = float(tail)
        if not math.isfinite(weight):
            raise GrpoConfigError(f"--reward {spec}: weight {tail} is not finite", field="reward")
        return head, weight
    return spec, 1.0


def load_reward(spec: str, *, max_new_tokens: int = 32) -> BoundReward:
    """The reward ``--reward SPEC`` names (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise GrpoConfigError(f"--reward {spec!r}: give a reward name or module:function")
    body, weight = _parse_weight(spec.strip())
    if body == "math":
        return bind(math_reward, name="math", weight=weight)
    if body == "exact":
        return bind(exact_reward, name="exact", weight=weight)
    if body == "length":
        return bind(length_reward(max_new_tokens), name="length", weight=weight)
    if body == "regex" or body.startswith("regex="):
        pattern = body.partition("=")[2]
        if not pattern:
            raise GrpoConfigError("--reward regex needs a pattern: regex=PATTERN", field="reward")
        try:
            fn = regex_reward(pattern)
        except re.error as exc:
            raise GrpoConfigError(
                f"--reward {spec}: {pattern!r} is not a regular expression: {exc}", field="reward"
            ) from exc
        return bind(fn, name="regex", weight=weight)
    target, sep, attr = body.rpartition(":")
    if not sep or not target or not attr:
        raise GrpoConfigError(
            f"--reward {spec}: not a built-in ({', '.join(BUILTINS)}) nor module:function or "
            "path/to/file.py:function",
            field="reward",
        )
    module = _import_target(spec, target)
    user: Any = getattr(module, attr, None)
    if user is None:
        raise GrpoConfigError(f"--reward {spec}: {target} has no {attr!r}", field="reward")
    try:
        return bind(user, name=attr, weight=weight)
    except GrpoConfigError as exc:
        raise GrpoConfigError(f"--reward {spec}: {exc}", field="reward") from exc


def _import_target(spec: str, target: str) -> Any:
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise GrpoConfigError(f"--reward {spec}: {target} does not exist", field="reward")
        module_name = f"posttrain_user_reward_{abs(hash(str(path)))}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise GrpoConfigError(f"--reward {spec}: {target} cannot be loaded", field="reward")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise GrpoConfigError(
                f"--reward {spec}: importing {target} failed: {type(exc).__name__}: {exc}",
                field="reward",
            ) from exc
        return module
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise GrpoConfigError(
            f"--reward {spec}: cannot import {target}: {type(exc).__name__}: {exc}",
            field="reward",
        ) from exc


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True, kw_only=True, slots=True)
class Scored:
    """One sample's reward (None when it failed), extra metrics, and the failure if any."""

    reward: float | None
    metrics: Mapping[str, float]
    failure: RewardSampleError | None = None


def _validate(value: Any, name: str) -> tuple[float, dict[str, float]]:
    extra: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise RewardSampleError(
                "no_reward_key", f"reward {name} returned a dict without 'reward': {value!r:.200}"
            )
        for key, item in value.items():
            if key != "reward":
                extra[f"reward/{key}"] = _number(item, f"{name} ['{key}']")
        value = value["reward"]
    return _number(value, name), extra


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:  # numpy and torch scalars
            import numbers

            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError
            value = float(value)
        except TypeError:
            raise RewardSampleError(
                "not_a_number", f"reward {name} returned {type(value).__name__} {value!r:.100}"
            ) from None
    result = float(value)
    if not math.isfinite(result):
        raise RewardSampleError("not_finite", f"reward {name} returned {result}")
    return result


def _arguments(reward: BoundReward, inputs: Sequence[RewardInput]) -> dict[str, Any]:
    fields = {
        "response": "response", "prompt": "prompt", "label": "label",
        "metadata": "metadata", "sample": "sample",
    }  # fmt: skip
    out: dict[str, Any] = {}
    for p in reward.params:
        singular = p[:-1] if reward.batched else p
        if singular == "input":
            values: list[Any] = list(inputs)
        else:
            values = [getattr(x, fields[singular]) for x in inputs]
        out[p] = values if reward.batched else values[0]
    return out


async def _call(reward: BoundReward, kwargs: dict[str, Any]) -> Any:
    value = reward.fn(kwargs["sample"]) if reward.positional_sample else reward.fn(**kwargs)
    if inspect.isawaitable(value):
        value = await value
    return value


def _failure(exc: BaseException, name: str) -> RewardSampleError:
    if isinstance(exc, RewardSampleError):
        return exc
    return RewardSampleError(
        type(exc).__name__, f"reward {name} raised {type(exc).__name__}: {exc}"
    )


async def _score_one_reward(
    reward: BoundReward, inputs: Sequence[RewardInput]
) -> list[tuple[float, dict[str, float]] | RewardSampleError]:
    if reward.batched:
        try:
            values = await _call(reward, _arguments(reward, inputs))
            if isinstance(values, str | bytes | Mapping) or not isinstance(values, Sequence):
                raise RewardSampleError(
                    "not_a_sequence",
                    f"batched reward {reward.name} returned {type(values).__name__}, not a list",
                )
            if len(values) != len(inputs):
                raise RewardSampleError(
                    "wrong_length",
                    f"batched reward {reward.name} returned {len(values)} results for "
                    f"{len(inputs)} samples",
                )
        except Exception as exc:
            failure = _failure(exc, reward.name)
            return [failure] * len(inputs)
        out: list[tuple[float, dict[str, float]] | RewardSampleError] = []
        for value in values:
            try:
                out.append(_validate(value, reward.name))
            except RewardSampleError as exc:
                out.append(exc)
        return out
    gate = asyncio.Semaphore(_CONCURRENCY)

    async def one(x: RewardInput) -> tuple[float, dict[str, float]] | RewardSampleError:
        async with gate:
            try:
                return _validate(await _call(reward, _arguments(reward, [x])), reward.name)
            except Exception as exc:
                return _failure(exc, reward.name)

    return list(await asyncio.gather(*(one(x) for x in inputs)))


async def score_async(
    rewards: Sequence[BoundReward], inputs: Sequence[RewardInput]
) -> list[Scored]:
    """Every sample's weighted reward sum and extra metrics (failures per sample, not raised)."""
    per_reward = [await _score_one_reward(r, inputs) for r in rewards]
    out: list[Scored] = []
    for k in range(len(inputs)):
        total = 0.0
        metrics: dict[str, float] = {}
        failure: RewardSampleError | None = None
        for reward, results in zip(rewards, per_reward, strict=True):
            result = results[k]
            if isinstance(result, RewardSampleError):
                failure = failure or result
                continue
            value, extra = result
            total += reward.weight * value
            if len(rewards) > 1:
                metrics[f"reward/{reward.name}"] = value
            metrics.update(extra)
        out.append(Scored(reward=None if failure else total, metrics=metrics, failure=failure))
    return out


def score(rewards: Sequence[BoundReward], inputs: Sequence[RewardInput]) -> list[Scored]:
    """``score_async`` from synchronous code."""
    return asyncio.run(score_async(rewards, inputs))


class Scorer:
    """A weighted sum of bound rewards: what ``--reward`` builds (a ``Task``'s reward)."""

    def __init__(self, rewards: Sequence[BoundReward]) -> None:
        if not rewards:
            raise GrpoConfigError("no reward: give --reward (e.g. --reward math)", field="reward")
        self.rewards = tuple(rewards)

    @classmethod
    def from_specs(cls, specs: Sequence[str], *, max_new_tokens: int = 32) -> Scorer:
        """The scorer ``--reward SPEC ...`` builds."""
        return cls([load_reward(s, max_new_tokens=max_new_tokens) for s in specs])

    def score(self, inputs: Sequence[RewardInput]) -> list[Scored]:
        """Every sample's reward (see ``score``)."""
        return score(self.rewards, inputs)


def as_bound(reward: Any) -> tuple[BoundReward, ...]:
    """The bound rewards behind a ``Task``'s reward: a ``Scorer``'s, or the callable bound by
    name (a ``RewardFunction`` taking ``sample`` binds as it always did)."""
    if isinstance(reward, Scorer):
        return reward.rewards
    name = str(getattr(reward, "__name__", type(reward).__name__))
    try:
        return (bind(reward, name=name),)
    except GrpoConfigError:
        # Today's RewardFunction callers: one positional parameter, the sample, by any name.
        sig = inspect.signature(reward)
        required = [p for p in sig.parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
        if len(required) != 1:
            raise
        return (BoundReward(name=name, fn=reward, params=("sample",), positional_sample=True),)


# --------------------------------------------------------------------------- a step's samples


def reward_input(
    sample: Sample, prompt: Prompt | None, decode: Callable[[Sequence[int]], str]
) -> RewardInput:
    """What a reward reads about ``sample`` (drawn from ``prompt``)."""
    if prompt is None:
        return RewardInput(
            response=decode(sample.response_ids), prompt=(), metadata=dict(sample.metadata),
            sample=sample,
        )  # fmt: skip
    shown: str | tuple[Mapping[str, Any], ...] = (
        prompt.text if prompt.text is not None else prompt.messages
    )
    metadata = prompt.row_metadata if prompt.row_metadata is not None else dict(prompt.metadata)
    return RewardInput(
        response=decode(sample.response_ids), prompt=shown, label=prompt.label,
        metadata=metadata, sample=sample,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class StepScores:
    """A step's scoring: the samples that got a reward (``reward`` set), the failed ones with
    their failure, and the metrics (means of the extra metrics, failure counts)."""

    kept: list[Sample]
    failed: list[tuple[Sample, RewardSampleError]]
    metrics: dict[str, float]


def score_samples(
    reward: Any,
    samples: Sequence[Sample],
    prompts: Mapping[int, Prompt],
    decode: Callable[[Sequence[int]], str],
) -> StepScores:
    """Score ``samples`` with a ``Task``'s reward; sets each kept sample's ``reward``."""
    rewards = as_bound(reward)
    inputs = [
        reward_input(s, prompts.get(int(s.metadata.get("prompt_index", -1))), decode)
        for s in samples
    ]
    scored = score(rewards, inputs)
    kept: list[Sample] = []
    failed: list[tuple[Sample, RewardSampleError]] = []
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    metrics: dict[str, float] = {"reward_failed_samples": 0.0}
    for s, result in zip(samples, scored, strict=True):
        if result.failure is not None or result.reward is None:
            assert result.failure is not None
            failed.append((s, result.failure))
            key = f"reward_failed/{result.failure.reason}"
            metrics[key] = metrics.get(key, 0.0) + 1.0
            metrics["reward_failed_samples"] += 1.0
            continue
        s.reward = result.reward
        kept.append(s)
        for key, value in result.metrics.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    metrics.update({key: sums[key] / counts[key] for key in sums})
    return StepScores(kept=kept, failed=failed, metrics=metrics)
