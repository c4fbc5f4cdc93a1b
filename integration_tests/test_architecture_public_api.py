"""One module-privacy convention across the packages (docs/architecture.md, "Module privacy").

A package's public API is ``posttrain.<pkg>`` itself: the names in its ``__init__``'s ``__all__``,
plus the public submodules its ``__init__`` names as entry points (in ``__all__``, such as
``posttrain.models.parity``, or by their dotted name in the ``__init__`` docstring, such as
``posttrain.interface.processes``). Import-linter's ``private-modules`` contract refuses another
package's ``_name`` module; this test (``ast``, nothing imported) holds the rest: the source of
one package uses another only through those public names, so a name that is not promised
cannot quietly become a contract.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PublicApi:
    names: frozenset[str]  # the __init__'s __all__
    docstring: str  # the __init__'s docstring (where entry-point submodules are named)

    def allows_module(self, package: str, submodule: str) -> bool:
        top = submodule.split(".")[0]
        return not top.startswith("_") and (
            top in self.names or f"posttrain.{package}.{top}" in self.docstring
        )


def _public_api(init: Path) -> PublicApi:
    tree = ast.parse(init.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names = {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return PublicApi(frozenset(names), ast.get_docstring(tree) or "")


def _packages() -> dict[str, tuple[Path, PublicApi]]:
    return {
        path.name: (path, _public_api(path / "__init__.py"))
        for path in sorted(ROOT.glob("packages/*/src/posttrain/*"))
        if (path / "__init__.py").exists()
    }


def violations(source: str, own: str, apis: dict[str, PublicApi], where: str) -> list[str]:
    """Each import in ``source`` (of package ``own``) that reaches past another's public API."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        else:
            continue
        for module, names in modules:
            parts = module.split(".")
            if parts[0] != "posttrain" or len(parts) < 2 or parts[1] == own:
                continue
            package, api = parts[1], apis.get(parts[1])
            if api is None:
                continue
            at = f"{where}:{node.lineno}"
            if len(parts) > 2:
                if not api.allows_module(package, ".".join(parts[2:])):
                    found.append(f"{at}: {module} is not a public module of posttrain.{package}")
                continue
            found += [
                f"{at}: {name!r} is not in posttrain.{package}.__all__"
                for name in names
                if name not in api.names and not api.allows_module(package, name)
            ]
    return found


def test_packages_use_one_another_through_public_names_only() -> None:
    packages = _packages()
    apis = {name: api for name, (_, api) in packages.items()}
    found: list[str] = []
    for own, (path, _) in packages.items():
        for file in sorted(path.rglob("*.py")):
            found += violations(file.read_text(), own, apis, str(file.relative_to(ROOT)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "from posttrain.lora.comm import group_size_not_exported_name",
        "from posttrain.lora.stacked import LoraStackedExperts",  # public module, not promised
        "from posttrain.models import _lora",
        "import posttrain.models._model",
        "from posttrain.models import NotAName",
        "def f():\n    from posttrain.interface._samples import Sample",
    ],
)
def test_a_reach_past_the_public_api_is_flagged(source: str) -> None:
    apis = {name: api for name, (_, api) in _packages().items()}
    assert violations(source, "grpo", apis, "scratch.py")


@pytest.mark.parametrize(
    "source",
    [
        "from posttrain.lora import group_size, init_full_factor",
        "from posttrain.models import MoeLayer, parity",
        "from posttrain.models.parity import packed_logprobs",
        "from posttrain.interface.processes import free_port",
        "import posttrain.interface.testing",
        "from posttrain.grpo._errors import GrpoRunError",  # its own package
    ],
)
def test_a_public_name_is_allowed(source: str) -> None:
    apis = {name: api for name, (_, api) in _packages().items()}
    assert violations(source, "grpo", apis, "scratch.py") == []
