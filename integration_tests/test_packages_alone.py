"""Each package installs alone, from its own directory, and its README example runs there.

For every ``packages/<name>``: a fresh venv (``uv venv``), the README's install line run as
written from the repository root (``pip`` is ``uv pip`` with the lock's versions as constraints,
so torch and friends are linked from uv's cache instead of downloaded), a check that no other
posttrain package than the ones the line names came along, then the README's ``standalone``
blocks run with that venv's Python. A package that imports something it does not declare fails
here (it does not fail in the workspace, where every package's dependencies are installed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_blocks import ROOT, Block, parse_blocks, run_block

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PACKAGES = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))


def _env(venv: Path, constraints: Path) -> dict[str, str]:
    # The workspace's own settings must not leak in (its venv, its Python, its bytecode policy);
    # uv's cache location and index settings stay, so the install is as fast as the user's.
    leaks = ("VIRTUAL_ENV", "UV_PROJECT", "UV_PROJECT_ENVIRONMENT", "UV_PYTHON", "UV_NO_SYNC",
             "UV_FROZEN", "UV_LOCKED", "UV_COMPILE_BYTECODE", "UV_CONSTRAINT")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in leaks}
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        UV_CONSTRAINT=str(constraints),
        UV_COMPILE_BYTECODE="0",  # compiling torch per venv would cost more than the test
        UV_NO_PROGRESS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _named_packages(install: Block) -> set[str]:
    return {f"posttrain-{m}" for m in re.findall(r"\./packages/([a-z-]+)", install.code)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("package", PACKAGES)
def test_package_installs_alone_and_its_example_runs(
    package: str, uv: str, lock_constraints: Path, tmp_path: Path
) -> None:
    blocks = parse_blocks(ROOT / "packages" / package / "README.md")
    (install,) = [b for b in blocks if "install" in b.directives]
    examples = [b for b in blocks if "standalone" in b.directives]
    assert examples, f"packages/{package}/README.md marks no standalone example"
    assert f"posttrain-{package}" in _named_packages(install), install.code

    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)],
                   check=True, timeout=120)  # fmt: skip
    env = _env(venv, lock_constraints)
    # `pip` in the README is uv's pip into this venv (the lock's versions, uv's cache).
    shim = f'pip() {{ "{uv}" pip "$@"; }}\n'
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shim + install.code], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=install.timeout_s, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{install.id}:\n{done.stdout}{done.stderr}"

    python = str(venv / "bin" / "python")
    listed = subprocess.run(
        [python, "-c", "import importlib.metadata as m, json; "
         "print(json.dumps(sorted(d.metadata['Name'] for d in m.distributions())))"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    ours = {n for n in json.loads(listed.stdout) if n.startswith("posttrain-")}
    assert ours == _named_packages(install), f"{install.id} installed {sorted(ours)}"

    workdir = tmp_path / "work"  # the examples run in order, in one directory
    workdir.mkdir()
    for block in examples:
        outcome = run_block(block, workdir=workdir, env=env, python=python)
        assert outcome.returncode == 0, f"{block.id}:\n{outcome.output[-4000:]}"
