"""No function in ``packages/*/src`` is longer than ``MAX_LINES`` lines (``def`` to its last line).

A long function is read as many steps at once; past this length it is split into named steps
(a route module per concern, a helper per process spec...). The walk is ``ast`` over the
sources, nothing imported; nested functions count inside their parent and on their own.
``ALLOWED`` names the functions allowed over the limit today, each with its length at the time:
it only shrinks (an entry whose function got short, or went away, fails the test too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 120

# "path:qualified.name" -> why it is still long. Empty: every function fits.
ALLOWED: dict[str, str] = {}


def long_functions(source: str, max_lines: int = MAX_LINES) -> dict[str, int]:
    """``{qualified name: lines}`` of each function in ``source`` longer than ``max_lines``."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > max_lines:
                    found[name] = length
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def _offenders() -> dict[str, int]:
    found: dict[str, int] = {}
    for file in sorted(ROOT.glob("packages/*/src/**/*.py")):
        where = file.relative_to(ROOT).as_posix()
        for name, length in long_functions(file.read_text()).items():
            found[f"{where}:{name}"] = length
    return found


def test_no_function_in_the_packages_is_longer_than_the_limit() -> None:
    offenders = _offenders()
    new = {k: v for k, v in offenders.items() if k not in ALLOWED}
    assert not new, f"functions over {MAX_LINES} lines (split them): " + ", ".join(
        f"{k} ({v} lines)" for k, v in sorted(new.items())
    )
    fixed = sorted(set(ALLOWED) - set(offenders))
    assert not fixed, f"now within {MAX_LINES} lines: remove {fixed} from ALLOWED"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n" + "    x = 1\n" * 120, {"f": 121}),
        ("def f():\n" + "    x = 1\n" * 119, {}),
        (
            "class C:\n    async def m(self):\n        def inner():\n"
            + "            y = 2\n" * 130,
            {"C.m": 132, "C.m.inner": 131},
        ),
    ],
)
def test_the_walk_measures_def_to_last_line(source: str, expected: dict[str, int]) -> None:
    assert long_functions(source) == expected
