"""A package's own tests need only that package and what its pyproject declares.

Every test that needs two or more posttrain packages lives in ``integration_tests/``. For each
``packages/<pkg>/tests/**/*.py`` (tests, conftest and helper modules alike) this reads the source
(``ast``, nothing is imported) and collects every ``posttrain.<x>`` module it needs:

- import statements anywhere in the file, lazy ones inside functions included;
- ``importorskip``, ``import_module``, ``find_spec`` and ``__import__`` calls on a literal name;
- a command line the test runs with its own interpreter: a list or tuple literal starting with
  ``sys.executable`` that holds ``"-m", "posttrain.<x>"``, or an f-string
  ``f"{sys.executable} -m posttrain.<x> ..."``; one inside a comparison is an expected value,
  not a run (launch's plans name ``-m posttrain.local_engine`` as data, and its golden files
  hold such plans: nothing runs them);
- Python code in a string literal (a ``python -c`` script): its import statements.

Each must be the package's own module, ``posttrain.interface``, or the module of a posttrain
package the package's pyproject declares (``dependencies`` or an extra; every package but
interface declares ``posttrain-formats``): so local-engine's tests may use models, grpo's the
packages it composes, launch's only formats (its ``local`` extra), interface's nothing. A test
breaking that fails here naming the file, line and module; move it to ``integration_tests/``.
The negative controls feed the checker synthetic sources that break the rule in each way.
"""

from __future__ import annotations

import ast
import itertools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALWAYS = frozenset({"interface"})
_IMPORTERS = frozenset({"importorskip", "import_module", "find_spec", "__import__"})
_DASH_M = re.compile(r"-m\s+posttrain\.(\w+)")


@dataclass(frozen=True, slots=True)
class Named:
    line: int
    module: str  # the x of posttrain.x
    how: str


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0]


def package_modules() -> dict[str, str]:
    """Package folder name -> its module under ``posttrain`` (``lora-core`` -> ``lora``)."""
    out: dict[str, str] = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        (module,) = [p.parent.name for p in pyproject.parent.glob("src/posttrain/*/__init__.py")]
        out[pyproject.parent.name] = module
    return out


def allowed_modules(package: str) -> frozenset[str]:
    """What ``packages/<package>/tests`` may need: its module, interface, its declared deps."""
    modules = package_modules()
    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    declared = {_requirement_name(r).removeprefix("posttrain-") for r in requirements}
    return ALWAYS | {modules[package]} | {modules[d] for d in declared if d in modules}


def _module_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "posttrain" else None


def _is_sys_executable(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "executable"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _compared(tree: ast.AST) -> set[int]:
    """ids of every node inside a comparison (expected values, not command lines run)."""
    return {id(n) for c in ast.walk(tree) if isinstance(c, ast.Compare) for n in ast.walk(c)}


def _run_with_dash_m(items: list[ast.expr]) -> list[str]:
    """``[sys.executable, ..., "-m", "posttrain.x", ...]``: the modules run."""
    if not items or not _is_sys_executable(items[0]):
        return []
    return [
        value.value
        for flag, value in itertools.pairwise(items)
        if isinstance(flag, ast.Constant) and flag.value == "-m"
        if isinstance(value, ast.Constant) and isinstance(value.value, str)
    ]


def _run_with_dash_m_fstring(node: ast.JoinedStr) -> list[str]:
    """``f"{sys.executable} -m posttrain.x ..."``: the modules run."""
    head = node.values[0] if node.values else None
    if not (isinstance(head, ast.FormattedValue) and _is_sys_executable(head.value)):
        return []
    text = "".join(str(v.value) for v in node.values if isinstance(v, ast.Constant))
    return [f"posttrain.{m.group(1)}" for m in _DASH_M.finditer(text)]


def named_modules(source: str, *, first_line: int = 1) -> list[Named]:
    """Every ``posttrain.<x>`` the source needs, as the module docstring lists them."""
    tree = ast.parse(source)
    compared = _compared(tree)
    found: list[Named] = []

    def add(node: ast.AST, dotted: str, how: str) -> None:
        module = _module_of(dotted)
        if module is not None:
            found.append(Named(first_line - 1 + getattr(node, "lineno", 1), module, how))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name, "import")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            add(node, node.module, "import")
            if node.module == "posttrain":
                for alias in node.names:
                    add(node, f"posttrain.{alias.name}", "import")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if name in _IMPORTERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(node, arg.value, name)
        elif isinstance(node, ast.List | ast.Tuple) and id(node) not in compared:
            for dotted in _run_with_dash_m(node.elts):
                add(node, dotted, "python -m")
        elif isinstance(node, ast.JoinedStr) and id(node) not in compared:
            for dotted in _run_with_dash_m_fstring(node):
                add(node, dotted, "python -m")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            code = node.value
            if "import" in code and "posttrain." in code:
                try:
                    inner = named_modules(code, first_line=node.lineno)
                except SyntaxError:
                    continue  # prose, not code
                found.extend(Named(n.line, n.module, f"{n.how} in a code string") for n in inner)
    return found


def violations(package: str, path: Path, source: str) -> list[str]:
    allowed = allowed_modules(package)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [
        f"{where}:{n.line}: {n.how} posttrain.{n.module} (packages/{package}/tests may need "
        f"only {', '.join(f'posttrain.{m}' for m in sorted(allowed))}): move the test to "
        "integration_tests/"
        for n in named_modules(source)
        if n.module not in allowed
    ]


def _test_files() -> list[tuple[str, Path]]:
    return [
        (package, path)
        for package in package_modules()
        for path in sorted((ROOT / "packages" / package / "tests").rglob("*.py"))
    ]


def test_every_package_test_needs_only_its_package_and_declared_dependencies() -> None:
    files = _test_files()
    assert len(files) > 80  # every package's tests were read
    broken = [v for package, path in files for v in violations(package, path, path.read_text())]
    assert not broken, "\n".join(broken)


def test_the_allowed_sets_follow_each_pyproject() -> None:
    assert allowed_modules("launch") == {"launch", "interface", "formats"}
    assert allowed_modules("session-router") == {"session_router", "interface", "formats"}
    assert allowed_modules("local-engine") == {"local_engine", "models", "interface", "formats"}
    assert {"lora", "opd", "session_router", "models", "fsdp_mesh"} <= allowed_modules("grpo")
    assert "grpo" not in allowed_modules("lora-core")


_SCRATCH = ROOT / "packages" / "{package}" / "tests" / "test_scratch.py"


@pytest.mark.parametrize(
    ("package", "source", "module", "line"),
    [
        ("formats", "import posttrain.session_router\n", "session_router", 1),
        ("lora-core", "from posttrain.models import build_model\n", "models", 1),
        ("session-router", "from posttrain import local_engine\n", "local_engine", 1),
        ("opd-scoring", "def test_x():\n    import posttrain.local_engine.server\n",
         "local_engine", 2),
        ("quant-convert", "import pytest\nm = pytest.importorskip('posttrain.models')\n",
         "models", 2),
        ("models", "import importlib\nimportlib.import_module('posttrain.lora')\n", "lora", 2),
        ("launch", "import subprocess, sys\n"
         "subprocess.run([sys.executable, '-m', 'posttrain.local_engine', '--help'])\n",
         "local_engine", 2),
        ("launch", "import sys\ncmd = f'{sys.executable} -m posttrain.session_router --x'\n",
         "session_router", 2),
        ("fsdp-mesh", "CODE = '''\nimport sys\nfrom posttrain.lora import attach_lora\n'''\n",
         "lora", 3),
        ("lora-core", "import posttrain.grpo\n", "grpo", 1),
        ("interface", "import subprocess, sys\n"
         "subprocess.run([sys.executable, '-c', 'import posttrain.formats'])\n", "formats", 2),
    ],
)  # fmt: skip
def test_the_checker_flags_a_test_that_needs_another_package(
    package: str, source: str, module: str, line: int
) -> None:
    path = Path(str(_SCRATCH).format(package=package))
    (found,) = violations(package, path, source)
    assert found.startswith(f"packages/{package}/tests/test_scratch.py:{line}: ")
    assert f"posttrain.{module} (packages/{package}/tests may need only" in found


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("local-engine", "import posttrain.models\nfrom posttrain.formats import peft_key\n"),
        ("grpo", "from posttrain.lora import attach_lora\nimport posttrain.opd\n"),
        # A plan's argv is data: compared, or not run with this interpreter.
        ("launch", "import sys\nassert plan[:3] == ['python', '-m', 'posttrain.local_engine']\n"
         "assert argv[:3] == [sys.executable, '-m', 'posttrain.grpo']\n"),
        ("formats", "NOTE = 'posttrain.session_router is not imported here'\n"),
    ],
)  # fmt: skip
def test_the_checker_lets_declared_dependencies_and_plan_data_pass(
    package: str, source: str
) -> None:
    assert violations(package, Path(str(_SCRATCH).format(package=package)), source) == []
