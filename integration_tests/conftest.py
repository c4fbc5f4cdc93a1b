"""Shared fixtures of the integration tests, and ``markdown_blocks`` / ``grpo_runs`` importable.

The helper modules next to this file (``markdown_blocks``: the doc tests' collector;
``grpo_runs``: ``posttrain grpo`` as a subprocess) are put on ``sys.path`` because pytest's
importlib mode does not. The fixtures:

``uv``
    the uv binary (``$UV``, which ``uv run`` sets, else the one on PATH); a test that needs it
    skips where there is none;
``lock_constraints``
    ``uv.lock``'s versions as pip constraints (``uv export``, made once per session), so a fresh
    venv installs exactly the versions the workspace runs, linked from uv's cache;
``recipe_cache``
    one ``POSTTRAIN_CACHE`` for every ``posttrain grpo`` run of the session (the integration
    tests and the README's block): the recipe warms up once, in the session's temp directory,
    never in the user's ``~/.cache``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if found is None:
        pytest.skip("uv is not on PATH")
    return found


@pytest.fixture(scope="session")
def lock_constraints(uv: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lock") / "constraints.txt"
    subprocess.run(
        [uv, "export", "--frozen", "--quiet", "--all-packages", "--all-extras", "--all-groups",
         "--no-hashes", "--no-emit-workspace", "--format", "requirements-txt", "-o", str(out)],
        cwd=HERE.parent, check=True, timeout=120,
    )  # fmt: skip
    return out


@pytest.fixture(scope="session")
def recipe_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "grpo-recipe-cache"
