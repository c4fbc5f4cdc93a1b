"""The README's code blocks run as written: Python blocks in process, the trainer commands
as real subprocesses (``uv run python`` is this interpreter)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
TEXT = README.read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
COMMANDS = [
    line.strip()
    for block in re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S)
    for line in block.splitlines()
    if line.strip().startswith("uv run python -m posttrain.grpo")
]


def test_the_readme_has_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 2
    assert len(COMMANDS) >= 3


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(PYTHON_BLOCKS[index], f"README block {index}", "exec"), {})
    assert capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_command_runs(command: str) -> None:
    argv = shlex.split(command.split("#", 1)[0])[3:]  # drop "uv run python"
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout
