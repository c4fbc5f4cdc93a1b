"""Every code block of every README and of docs/ runs as written (see ``markdown_blocks``).

Blocks a package README marks ``install``/``standalone`` run in ``test_packages_alone`` (a fresh
venv per package); every other block runs here, in the workspace, in a fresh temporary
directory, with ``POSTTRAIN_CACHE`` pointing into the session's temporary directory (the
``recipe_cache`` fixture): ``posttrain grpo``'s recipe cache never lands in the user's
``~/.cache``. A block fails with its output shown, so a wrong example names itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from markdown_blocks import ROOT, Block, all_blocks, markdown_files, run_block, workspace_env

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

BLOCKS = all_blocks()
HERE = [b for b in BLOCKS if b.lang != "text" and not {"install", "standalone"} & set(b.directives)]


def test_the_convention_covers_every_markdown_file() -> None:
    assert ROOT / "README.md" in markdown_files()
    assert len(markdown_files()) >= 12
    # Each package README gives its install line and an example for test_packages_alone.
    for readme in sorted((ROOT / "packages").glob("*/README.md")):
        mine = [b for b in BLOCKS if b.path == readme]
        assert sum("install" in b.directives for b in mine) == 1, readme
        assert any("standalone" in b.directives for b in mine), readme


@pytest.mark.parametrize("block", HERE, ids=[b.id for b in HERE])
def test_block_runs_as_written(block: Block, tmp_path: Path, recipe_cache: Path) -> None:
    if "skip" in block.directives:
        pytest.skip(block.directives["skip"] or "marked skip")
    if "benchmark" in block.directives and os.environ.get("POSTTRAIN_DOCS_BENCHMARKS") != "1":
        pytest.skip("a benchmark run (minutes of CPU); set POSTTRAIN_DOCS_BENCHMARKS=1 to run it")
    # Benchmark commands name scripts by their path in the repository, as docs/ says.
    workdir = ROOT if "benchmark" in block.directives else tmp_path
    # The recipe cache `posttrain grpo` warms up is the session's (shared with the integration
    # tests' runs), never the user's ~/.cache.
    env = {**workspace_env(), "POSTTRAIN_CACHE": str(recipe_cache)}
    outcome = run_block(block, workdir=workdir, env=env)
    assert outcome.ready, f"{block.id}: never printed its ready line:\n{outcome.output[-4000:]}"
    assert outcome.returncode == 0, (
        f"{block.id} exited {outcome.returncode}:\n{outcome.output[-4000:]}"
    )
