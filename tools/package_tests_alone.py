"""Run each package's own tests in a fresh venv holding only that package and what it declares.

``uv run python tools/package_tests_alone.py [PACKAGE ...]`` (default: every package). Per
package: ``uv venv``, then ``uv pip install`` of the package with all its extras, the posttrain
packages its pyproject declares (from ``./packages``), ``posttrain-interface``, and pytest with
its plugins, at ``uv.lock``'s versions (linked from uv's cache); then ``pytest
packages/<name>/tests`` with that venv's Python from the repository root (the root pytest
configuration applies). A test that needs an undeclared package fails there, which the
workspace, where everything is installed, never shows. It takes minutes per package on 2 cores,
so CI does not run it; ``integration_tests/test_package_tests_isolated.py`` holds the same rule
statically on every run. Prints one line per package and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_TOOLS = ("pytest", "pytest-timeout", "hypothesis", "numpy")


def declared_posttrain(package: str) -> list[str]:
    """The posttrain packages (folder names) ``package``'s pyproject declares, extras included."""
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    requirements = list(project["project"].get("dependencies", []))
    for extra in project["project"].get("optional-dependencies", {}).values():
        requirements.extend(extra)
    names = (re.split(r"[\s\[<>=!~;@]", r.strip(), maxsplit=1)[0] for r in requirements)
    return sorted({n.removeprefix("posttrain-") for n in names if n.startswith("posttrain-")})


def install_spec(package: str) -> str:
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    extras = ",".join(project["project"].get("optional-dependencies", {}))
    return f"./packages/{package}[{extras}]" if extras else f"./packages/{package}"


def run_package(package: str, uv: str, constraints: Path, workdir: Path) -> tuple[bool, str]:
    venv = workdir / f"venv-{package}"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT")}
    env.update(VIRTUAL_ENV=str(venv), UV_COMPILE_BYTECODE="0", UV_NO_PROGRESS="1")
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)],
                   check=True, env=env, timeout=300)  # fmt: skip
    peers = {"interface", *declared_posttrain(package)} - {package}
    subprocess.run(
        [uv, "pip", "install", "--quiet", "-c", str(constraints),
         *(f"./packages/{p}" for p in sorted(peers)), install_spec(package), *TEST_TOOLS],
        cwd=ROOT, check=True, env=env, timeout=900,
    )  # fmt: skip
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pytest", "-q", f"packages/{package}/tests"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, f"with {', '.join(sorted(peers)) or 'nothing else'}: {lines[-1]}"


def main() -> int:
    packages = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", choices=[[], *packages], default=[])
    args = parser.parse_args()
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        parser.error("uv is not on PATH")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="package-tests-alone-") as tmp:
        work = Path(tmp)
        constraints = work / "constraints.txt"
        subprocess.run(
            [uv, "export", "--frozen", "--quiet", "--all-packages", "--all-extras",
             "--all-groups", "--no-hashes", "--no-emit-workspace", "--format",
             "requirements-txt", "-o", str(constraints)],
            cwd=ROOT, check=True, timeout=300,
        )  # fmt: skip
        for package in args.packages or packages:
            start = time.monotonic()
            ok, summary = run_package(package, uv, constraints, work)
            failed += not ok
            status = "ok  " if ok else "FAIL"
            print(
                f"{status} {package:<15} {time.monotonic() - start:6.0f} s  {summary}", flush=True
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
