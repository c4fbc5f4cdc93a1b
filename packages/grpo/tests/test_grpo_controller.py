"""``run_on_rank0`` on real gloo ranks against the single-process call: every rank gets rank 0's
value, or raises an exception of the same type with the same message (a project error whose
``__init__`` is not its ``args``, a built-in one, one whose class cannot cross), and only rank 0
computes; over an explicit subgroup, its own rank 0 computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from posttrain.grpo import GrpoRunError, GrpoUnsupportedError
from posttrain.grpo._controller import run_on_rank0
from posttrain.grpo.preflight import PreflightError
from posttrain.interface.testing import run_workers


def _value() -> dict[str, Any]:
    return {"train": [1, 2, 3], "stats": {"reward_mean": 0.25}, "url": "http://127.0.0.1:1"}


def _preflight() -> None:
    raise PreflightError(["--task: no such file: x.jsonl", "--reward: not importable: m:f"])


def _unsupported() -> None:
    raise GrpoUnsupportedError("weight_sync", "--weight-sync tensor needs a GPU")


def _builtin() -> None:
    raise KeyError("prompt_index")


def _local_error() -> None:
    class UnimportableError(Exception):  # defined in a function: pickle cannot name it
        pass

    raise UnimportableError("a class of its own")


CASES: dict[str, Callable[[], Any]] = {
    "value": _value,
    "preflight": _preflight,
    "unsupported": _unsupported,
    "builtin": _builtin,
    "local": _local_error,
}


def _outcome(compute: Callable[[], Any], group: dist.ProcessGroup | None) -> tuple[Any, ...]:
    """What a rank saw: ("value", v) or ("raised", type name, message, its attributes)."""
    try:
        return ("value", run_on_rank0(compute, group=group))
    except Exception as exc:
        attrs = {k: v for k, v in vars(exc).items() if not k.startswith("__")}
        return ("raised", type(exc).__name__, str(exc), attrs)


def _only_rank0(compute: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        if dist.get_rank() != 0:
            raise AssertionError(f"rank {dist.get_rank()} computed")
        return compute()

    return call


def _every_case(rank: int, world: int) -> dict[str, tuple[Any, ...]]:
    return {name: _outcome(_only_rank0(fn), group=None) for name, fn in CASES.items()}


def _in_subgroup(rank: int, world: int) -> tuple[Any, ...] | None:
    sub = dist.new_group([1, 2])  # every rank makes it; its rank 0 is global rank 1

    def on_global_rank1() -> str:
        if dist.get_rank() != 1:
            raise AssertionError(f"rank {dist.get_rank()} computed")
        raise GrpoRunError("weight sync: computed on global rank 1")

    return _outcome(on_global_rank1, group=sub) if rank in (1, 2) else None


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, tuple[Any, ...]]]:
    return run_workers(_every_case, 2, timeout_s=60)


def test_without_a_group_it_is_the_call_itself() -> None:
    assert not dist.is_initialized()
    assert run_on_rank0(_value, group=None) == _value()
    with pytest.raises(PreflightError) as caught:
        run_on_rank0(_preflight, group=None)
    assert caught.value.failures == (
        "--task: no such file: x.jsonl",
        "--reward: not importable: m:f",
    )


@pytest.mark.parametrize("case", ["value", "preflight", "unsupported", "builtin"])
def test_every_rank_gets_what_one_process_gets(
    two_ranks: list[dict[str, tuple[Any, ...]]], case: str
) -> None:
    single = _outcome(CASES[case], group=None)  # no process group here: compute() itself
    assert [ranks[case] for ranks in two_ranks] == [single, single]


def test_a_project_error_keeps_its_fields_on_every_rank(
    two_ranks: list[dict[str, tuple[Any, ...]]],
) -> None:
    for ranks in two_ranks:
        kind, name, message, attrs = ranks["preflight"]
        assert (kind, name) == ("raised", "PreflightError")
        assert message == "--task: no such file: x.jsonl\n--reward: not importable: m:f"
        assert attrs["failures"] == (
            "--task: no such file: x.jsonl",
            "--reward: not importable: m:f",
        )
        _, name, _, attrs = ranks["unsupported"]
        assert (name, attrs["field"]) == ("GrpoUnsupportedError", "weight_sync")


def test_an_exception_that_cannot_cross_is_a_run_error_naming_it_elsewhere(
    two_ranks: list[dict[str, tuple[Any, ...]]],
) -> None:
    rank0, rank1 = (ranks["local"] for ranks in two_ranks)
    assert rank0[:3] == ("raised", "UnimportableError", "a class of its own")  # the original
    assert rank1[:3] == ("raised", "GrpoRunError", "rank 0: UnimportableError: a class of its own")


def test_over_an_explicit_subgroup_its_rank0_computes() -> None:
    outcomes = run_workers(_in_subgroup, 3, timeout_s=60)
    expected = ("raised", "GrpoRunError", "weight sync: computed on global rank 1", {})
    assert outcomes == [None, expected, expected]
