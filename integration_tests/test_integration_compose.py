"""The composable-pipeline example of docs/compose.md: GRPO on an engine and a reward of one's own.

The guide's one ``python`` block is the example and this test runs it as written (so the guide
cannot go stale; the docs-block test skips it for that reason). The block plugs a rollout
engine that is not ours (Hugging Face ``transformers`` sampling in process, speaking the
interface's ``RolloutEngine`` and ``WeightSink``) and its own ``RewardFunction`` into
``posttrain.grpo.loop.run``, trains three full-parameter steps on CPU and asserts what the
composition promises (see the guide). Here, besides: the block must not lean on our engines or
routers (no import of them), and what it prints must show every step and every push.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_blocks import ROOT, Block, parse_blocks, run_block, workspace_env

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

GUIDE = ROOT / "docs" / "compose.md"
RUFF = Path(sys.executable).with_name("ruff")
OURS = ("posttrain.local_engine", "posttrain.session_router", "posttrain.opd")


def _example() -> Block:
    """The guide's full example (its other block, the dataset and reward one, runs as a doc test)."""
    (block,) = [
        b for b in parse_blocks(GUIDE)
        if b.lang == "python" and "test_integration_compose" in b.directives.get("skip", "")
    ]  # fmt: skip
    return block


def _imported(code: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_example_brings_its_own_engine() -> None:
    block = _example()
    assert "run by integration_tests/test_integration_compose.py" in block.directives["skip"]
    leaning = {n for n in _imported(block.code) if n.startswith(OURS)}
    assert not leaning, f"{block.id} imports {sorted(leaning)}: the engine must be its own"
    classes = {n.name for n in ast.walk(ast.parse(block.code)) if isinstance(n, ast.ClassDef)}
    assert {"TransformersEngine", "DigitReward"} <= classes
    # The guide's code is held to the project's style, like the code it shows.
    for check in (["check"], ["format", "--check"]):
        done = subprocess.run(
            [str(RUFF), *check, "--stdin-filename", "integration_tests/compose_example.py", "-"],
            input=block.code, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{block.id}: ruff {' '.join(check)}:\n{done.stdout}"


@pytest.mark.timeout(600)
def test_the_example_trains_on_its_own_engine_and_reward(tmp_path: Path) -> None:
    block = _example()
    outcome = run_block(block, workdir=tmp_path, env=workspace_env())
    assert outcome.returncode == 0, f"{block.id}:\n{outcome.output[-4000:]}"
    printed = [line for line in outcome.output.splitlines() if line.startswith('{"rewards"')]
    assert len(printed) == 1, outcome.output[-4000:]
    report = json.loads(printed[0])
    assert report["version"] == 4  # the first push and one per step, each applied
    assert report["samples"] == 3 * 2 * 4  # steps x prompts x samples, each scored once
    assert len(report["rewards"]) == 3
    assert report["weights_moved"] > 0
    assert (tmp_path / "compose-run" / "run" / "summary.json").is_file()
