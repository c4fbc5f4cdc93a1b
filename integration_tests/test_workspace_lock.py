"""The lock installs anywhere the README promises, from the package index alone.

A fresh clone must install on Linux x86_64/aarch64 and macOS arm64 with CPython 3.11-3.13:
the lock's environments say so, every locked package comes from the index (or is one of ours),
and no file of the project names a path of one machine (an earlier lock pinned torch to a
wheel file on this machine's disk, and every other machine failed at once).
"""

from __future__ import annotations

import re
import subprocess
import tomllib

from markdown_blocks import ROOT

PLATFORMS = (
    "platform_machine == 'x86_64' and sys_platform == 'linux'",
    "platform_machine == 'aarch64' and sys_platform == 'linux'",
    "platform_machine == 'arm64' and sys_platform == 'darwin'",
)


def test_the_lock_covers_every_promised_platform_and_python() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    assert lock["requires-python"] == ">=3.11"
    supported = lock["supported-markers"]
    for platform in PLATFORMS:
        assert [m for m in supported if platform in m] == [
            f"python_full_version < '3.14' and {platform}"
        ]
    assert lock["required-markers"] == list(PLATFORMS)  # a wheel for each, or `uv lock` fails


def test_every_locked_package_comes_from_the_index_or_the_workspace() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    for package in lock["package"]:
        (kind,) = package["source"]
        if kind == "registry":
            assert package["source"]["registry"] == "https://pypi.org/simple", package["name"]
        else:
            assert kind in ("editable", "virtual"), (package["name"], package["source"])
            assert package["name"].startswith("posttrain-"), package["name"]


def test_no_tracked_file_names_a_machine_path() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.toml", "*.lock", ".ci/*", "*.md", "*.txt"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    # A wheel file, a source at an absolute path, or a directory of this machine's image.
    pattern = re.compile(r"\.whl\b|path\s*=\s*\"/|/opt/|/root/")
    offenders = [
        f"{name}:{n}: {line.strip()}"
        for name in tracked
        if not name.startswith("docs/benchmarks/")  # logs of past GPU runs, quoted as they ran
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
        if pattern.search(line) and "files.pythonhosted.org" not in line
    ]
    assert offenders == []


def test_benchmark_only_groups_stay_out_of_the_default_install() -> None:
    # TRL is for packages/grpo/benchmarks/bench_vs_trl.py only: `uv sync`, `uv run pytest` and
    # CI install the default groups, which must not pull it in.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = project["dependency-groups"]
    defaults = project["tool"]["uv"].get("default-groups", ["dev"])
    assert any(r.startswith("trl") for r in groups["bench-trl"])
    assert "bench-trl" not in defaults
    assert not [r for name in defaults for r in groups[name] if str(r).startswith("trl")]
