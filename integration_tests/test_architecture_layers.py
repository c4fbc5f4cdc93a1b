"""The layers of docs/architecture.md hold: import-linter's contracts pass, and a forbidden import fails.

The contracts live in the root pyproject.toml (``[tool.importlinter]``). The negative tests copy
every package's sources into a scratch directory, add one module with a forbidden import, and
run the same contracts against the copy (put first on ``PYTHONPATH``): they must break, naming
the contract (a private module ``posttrain.<pkg>._name`` imported from another package breaks
``private-modules``). Positive controls (local-engine importing models, the one allowed sideways
import; grpo importing the capability packages it composes) must stay kept.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")  # one line per contract in the report
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
        check=False,
    )


def _package_modules() -> set[str]:
    return {
        f"posttrain.{module.name}"
        for module in ROOT.glob("packages/*/src/posttrain/*")
        if module.is_dir() and (module / "__init__.py").exists()
    }


def test_every_package_is_a_root_package_of_the_contracts() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    missing = _package_modules() - set(config["root_packages"])
    assert not missing, f"add {sorted(missing)} to [tool.importlinter] root_packages and a layer"


def test_the_contracts_are_kept() -> None:
    result = _lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _scratch_copy(tmp_path: Path, module: str, source: str) -> Path:
    """Every package's ``posttrain/*`` sources under tmp_path, plus ``module`` holding ``source``."""
    for package in ROOT.glob("packages/*/src/posttrain/*"):
        if package.is_dir():
            shutil.copytree(
                package,
                tmp_path / "posttrain" / package.name,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
    path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    path.write_text(f'"""A deliberately layered-wrong module (test scratch)."""\n\n{source}\n')
    return tmp_path


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("posttrain.interface._scratch", "import posttrain.formats", "layers:"),
        ("posttrain.formats._scratch", "import posttrain.lora", "layers:"),
        ("posttrain.lora._scratch", "from posttrain.opd import OPDConfig", "layers:"),
        (
            "posttrain.session_router._scratch",
            "import posttrain.local_engine",
            "layers:",
        ),
        ("posttrain.local_engine._scratch", "import posttrain.lora", "local-engine imports models"),
        (
            "posttrain.launch._scratch",
            "import posttrain.session_router",
            "launch imports no capability",
        ),
        ("posttrain.launch._scratch", "import posttrain.grpo", "launch does not import grpo"),
        ("posttrain.lora._scratch", "import posttrain.grpo", "layers:"),
        ("posttrain.grpo._scratch", "import posttrain.launch", "layers:"),
        # Another package's private module (``_name``), even for a type only.
        (
            "posttrain.grpo._scratch",
            "from posttrain.models._model import MoeLayer",
            "private modules",
        ),
        ("posttrain.local_engine._scratch", "import posttrain.models._lora", "private modules"),
        (
            "posttrain.session_router._scratch",
            "from posttrain.interface._samples import Sample",
            "private modules",
        ),
    ],
)
def test_a_forbidden_import_breaks_the_contracts(
    tmp_path: Path, module: str, source: str, broken: str
) -> None:
    result = _lint(_scratch_copy(tmp_path, module, source))
    assert result.returncode != 0, result.stdout
    assert module in result.stdout
    broken_lines = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(broken) for line in broken_lines), result.stdout


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("posttrain.local_engine._scratch", "import posttrain.models"),
        # grpo composes the capability packages (and formats) through their public names.
        (
            "posttrain.grpo._scratch",
            "import posttrain.lora\nimport posttrain.opd\nimport posttrain.formats",
        ),
        # A package's own private modules, from anywhere inside it; public modules of others.
        ("posttrain.models.context_parallel._scratch", "import posttrain.models._model"),
        ("posttrain.grpo._scratch", "import posttrain.models.parity\nimport posttrain.lora.comm"),
        ("posttrain.session_router._scratch", "import posttrain.interface.processes"),
    ],
)
def test_an_allowed_import_keeps_the_contracts(tmp_path: Path, module: str, source: str) -> None:
    result = _lint(_scratch_copy(tmp_path, module, source))
    assert result.returncode == 0, result.stdout + result.stderr
