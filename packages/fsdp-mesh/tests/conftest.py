"""Shared test plumbing: one way to start a group of gloo ranks, and the two shared groups.

Worker functions live in ``fsdp_mesh_workers.py`` (an importable module: spawned ranks must
import the function by name, which pytest's importlib mode does not allow for test modules).
``run_ranks`` runs them with ``posttrain.interface.testing.run_workers``: ranks are forked from
this warm process (torch, FSDP, DCP and dynamo imported once, here), so a group starts in about a
second.

Gloo start-up and first-use costs dominate, so one W=4 group and one W=2 group run all of
their checks (``w4_suite``/``w2_suite``) once per session; the tests assert on their results.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import fsdp_mesh_workers as workers
import torch._dynamo  # noqa: F401  (the first optimizer step imports it lazily: warm it once here)

from posttrain.interface.testing import run_workers


def run_ranks(
    fn: Callable[..., Any], world_size: int, *, timeout_s: float, args: tuple[Any, ...] = ()
) -> list[Any]:
    return run_workers(fn, world_size, timeout_s=timeout_s, args=args)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp_mesh_ckpt")


@pytest.fixture(scope="session")
def w4(ckpt_root: Path) -> list[dict[str, Any]]:
    return run_ranks(workers.w4_suite, 4, timeout_s=200, args=(str(ckpt_root),))


@pytest.fixture(scope="session")
def w2(ckpt_root: Path, w4: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return run_ranks(workers.w2_suite, 2, timeout_s=150, args=(str(ckpt_root),))
