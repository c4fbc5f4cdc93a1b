"""The layers of docs/architecture.md hold: import-linter's contracts pass, and a forbidden import fails.

The contracts live in the root pyproject.toml (``[tool.importlinter]``). The negative tests copy
every package's sources into a scratch directory, add one module with a forbidden import, and
run the same contracts against the copy (put first on ``PYTHONPATH``): they must break, naming
the contract. A positive control (local-engine importing models, the one allowed sideways
import) must stay kept.
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


def _lint(
    pythonpath: Path | None = None, config: Path = ROOT / "pyproject.toml"
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="200")  # one line per contract in the report
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(config)],
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


def test_local_engine_may_import_models(tmp_path: Path) -> None:
    result = _lint(
        _scratch_copy(tmp_path, "posttrain.local_engine._scratch", "import posttrain.models")
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _with_grpo(tmp_path: Path, grpo_source: str) -> Path:
    """A config whose root packages include ``posttrain.grpo`` (written into the scratch copy)."""
    grpo = tmp_path / "posttrain" / "grpo"
    grpo.mkdir(parents=True, exist_ok=True)
    (grpo / "__init__.py").write_text(f'"""A stand-in grpo (test scratch)."""\n\n{grpo_source}\n')
    text = (ROOT / "pyproject.toml").read_text()
    if '"posttrain.grpo"' not in text:  # until posttrain.grpo lands in the workspace
        text = text.replace("root_packages = [\n", 'root_packages = [\n    "posttrain.grpo",\n', 1)
    config = tmp_path / "pyproject.toml"
    config.write_text(text)
    return config


@pytest.mark.parametrize(
    ("scratch", "grpo_source", "broken"),
    [
        (("posttrain.launch._scratch", "import posttrain.grpo"), "", "launch does not import grpo"),
        (("posttrain.lora._scratch", "import posttrain.grpo"), "", "layers:"),
        (None, "import posttrain.launch", "layers:"),
        (None, "import posttrain.lora\nimport posttrain.opd\nimport posttrain.formats", None),
    ],
)
def test_grpo_joins_between_the_capabilities_and_launch(
    tmp_path: Path, scratch: tuple[str, str] | None, grpo_source: str, broken: str | None
) -> None:
    module, source = scratch or ("posttrain.formats._scratch", "")
    root = _scratch_copy(tmp_path, module, source)
    result = _lint(root, _with_grpo(tmp_path, grpo_source))
    if broken is None:  # grpo composes the capability packages: allowed
        assert result.returncode == 0, result.stdout + result.stderr
        return
    assert result.returncode != 0, result.stdout
    broken_lines = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(broken) for line in broken_lines), result.stdout
