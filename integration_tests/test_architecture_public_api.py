"""One module-privacy convention across the packages (docs/architecture.md, "Module privacy").

A package's public API is ``posttrain.<pkg>`` itself: the names in its ``__init__``'s ``__all__``,
plus the public submodules its ``__init__`` names as entry points (in ``__all__``, such as
``posttrain.models.parity``, or by their dotted name in the ``__init__`` docstring, such as
``posttrain.interface.processes``). Import-linter's ``private-modules`` contract refuses another
package's ``_name`` module; this test (``ast``, nothing imported) holds the rest: the source of
one package uses another only through those public names, so a name that is not promised
cannot quietly become a contract. It also reads for private *members* reached through objects:
no package overrides, reads or sets another's ``_name`` attributes (a subclass's extension
points are the base's public methods, such as ``DecoderModel.moe``).
"""

from __future__ import annotations

import ast
import functools
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


# ---------------------------------------------------------------- private members of objects
# An import check does not see ``model._experts_eager`` or an override of ``DecoderModel._moe``:
# a subclass or a caller can reach another package's private *members* through objects it was
# given. The check below reads the same sources (``ast``) for that.

_ACCESSORS = ("getattr", "setattr", "delattr", "hasattr")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class PrivateMembers:
    """The ``_name`` members one package's source defines.

    ``classes``: per class name, its members (methods, class attributes, ``self._x`` it
    assigns) and the names of its bases; ``every``: those of every class and module."""

    classes: dict[str, tuple[frozenset[str], tuple[str, ...]]]
    every: frozenset[str]

    def of_class(self, name: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
        """``name``'s private members with those of its bases defined in the same package."""
        if name not in self.classes or name in seen:
            return frozenset()
        members, bases = self.classes[name]
        for base in bases:
            members |= self.of_class(base, seen | {name})
        return members


def _string_arg(call: ast.Call) -> tuple[ast.expr, str] | None:
    """``(obj, "name")`` of ``getattr(obj, "name", ...)`` and its kin, or of
    ``object.__setattr__(obj, "name", value)``."""
    func = call.func
    named = isinstance(func, ast.Name) and func.id in _ACCESSORS
    dunder = isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__getattribute__")
    if (named or dunder) and len(call.args) >= 2:
        key = call.args[1]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return call.args[0], key.value
    return None


def _sets(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"
    )


def _accesses(tree: ast.AST) -> list[tuple[ast.expr, str, int]]:
    """Each ``obj._x`` (read, write or delete) and ``getattr(obj, "_x")`` in ``tree``."""
    found: list[tuple[ast.expr, str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            found.append((node.value, node.attr, node.lineno))
        elif isinstance(node, ast.Call) and (hit := _string_arg(node)) and _is_private(hit[1]):
            found.append((hit[0], hit[1], node.lineno))
    return found


def _defined_names(body: list[ast.stmt]) -> set[str]:
    """The functions, classes and plain assignments of a module's or a class's body."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _private_members(root: Path) -> PrivateMembers:
    classes: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {}
    every: set[str] = set()
    for file in sorted(root.rglob("*.py")):
        tree = ast.parse(file.read_text())
        every |= _defined_names(tree.body)
        for node in ast.walk(tree):  # members set on objects: ``x._name = ...``, setattr
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                every.add(node.attr)
            elif isinstance(node, ast.Call) and (hit := _string_arg(node)) and _sets(node):
                every.add(hit[1])
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            members = _defined_names(cls.body)
            members.update(
                name
                for obj, name, _ in _accesses(cls)
                if isinstance(obj, ast.Name) and obj.id == "self"
            )
            bases = tuple(
                b.id if isinstance(b, ast.Name) else b.attr
                for b in cls.bases
                if isinstance(b, (ast.Name, ast.Attribute))
            )
            old, old_bases = classes.get(cls.name, (frozenset(), ()))
            private = frozenset(m for m in members if _is_private(m))
            classes[cls.name] = (old | private, old_bases + bases)
            every.update(private)
    return PrivateMembers(classes, frozenset(n for n in every if _is_private(n)))


def _foreign_imports(tree: ast.AST, own: str) -> dict[str, tuple[str, str]]:
    """Local name -> (package, name) for each ``from posttrain.<other> import name``."""
    out: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "posttrain" and len(parts) == 2 and parts[1] != own:
                for alias in node.names:
                    out[alias.asname or alias.name] = (parts[1], alias.name)
    return out


def _is_self_or_super(obj: ast.expr) -> bool:
    if isinstance(obj, ast.Name):
        return obj.id in ("self", "cls")
    return isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super"


def member_violations(
    source: str, own: str, members: dict[str, PrivateMembers], where: str
) -> list[str]:
    """Each reach in ``source`` (of package ``own``) into another package's private members:
    a subclass of another package's class that overrides, reads or writes one of the base's
    ``_name`` members (``def _moe``, ``super()._moe``, ``self._lora_targets``), and an
    ``obj._name`` / ``getattr(obj, "_name")`` on any other object where ``_name`` is a private
    member of another package and no name of ``own``'s."""
    tree = ast.parse(source)
    imported = _foreign_imports(tree, own)
    own_names = members[own].every if own in members else frozenset()
    foreign = frozenset().union(*(m.every for pkg, m in members.items() if pkg != own))
    found: list[str] = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for base in cls.bases:
            if not (isinstance(base, ast.Name) and base.id in imported):
                continue
            package, name = imported[base.id]
            private = members[package].of_class(name) if package in members else frozenset()
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    item.name in private
                ):
                    found.append(
                        f"{where}:{item.lineno}: {cls.name} overrides {name}.{item.name}, "
                        f"a private member of posttrain.{package}"
                    )
            for obj, attr, line in _accesses(cls):
                if _is_self_or_super(obj) and attr in private:
                    found.append(
                        f"{where}:{line}: {cls.name} reaches {name}.{attr}, a private member "
                        f"of posttrain.{package}"
                    )
    for obj, attr, line in _accesses(tree):
        if not _is_self_or_super(obj) and attr in foreign and attr not in own_names:
            found.append(
                f"{where}:{line}: .{attr} is a private member of another package "
                f"({ast.unparse(obj)}.{attr})"
            )
    return found


@functools.cache
def _all_private_members() -> dict[str, PrivateMembers]:
    return {name: _private_members(path) for name, (path, _) in _packages().items()}


def test_packages_reach_one_anothers_objects_through_public_members_only() -> None:
    """No package's source overrides, reads or sets another's private members. The case it was
    written for: grpo's megatron backend subclasses and drives ``posttrain.models``' decoder
    and ``posttrain.lora``'s layers through their public names only (the models README,
    "Extension points": ``moe``, ``scatter_sequence``, ``gather_sequence``,
    ``gather_layer_tokens``)."""
    members = _all_private_members()
    found: list[str] = []
    for own, (path, _) in _packages().items():
        for file in sorted(path.rglob("*.py")):
            where = str(file.relative_to(ROOT))
            found += member_violations(file.read_text(), own, members, where)
    assert not found, "\n".join(found)


_DECODER_SUBCLASS = """
from posttrain.models import DecoderModel

class Split(DecoderModel):
{body}
"""


@pytest.mark.parametrize(
    "source",
    [
        _DECODER_SUBCLASS.format(body="    def _pack(self, ids, lengths):\n        return ids"),
        _DECODER_SUBCLASS.format(body="    def f(self):\n        return super()._pack(1, 2)"),
        _DECODER_SUBCLASS.format(body="    def f(self):\n        return self._lora_targets"),
        _DECODER_SUBCLASS.format(body="    def f(self):\n        self._lora_targets = {}"),
        _DECODER_SUBCLASS.format(body="    def f(self):\n        return self._add_sites()"),
        "def f(layer):\n    return layer._experts_by_id",
        "def f(model):\n    return getattr(model, '_lora_targets', None)",
        "def f(model):\n    object.__setattr__(model, '_compile_state', None)",
        "from posttrain.lora import LoraLinear\n\n"
        "class L(LoraLinear):\n    def f(self):\n        return self._reduce",
    ],
)
def test_a_reach_into_private_members_is_flagged(source: str) -> None:
    members = _all_private_members()
    assert member_violations(source, "grpo", members, "scratch.py")


@pytest.mark.parametrize(
    "source",
    [
        _DECODER_SUBCLASS.format(
            body="    def moe(self, layer, m, lora, prefix):\n"
            "        return super().moe(layer, m, lora, prefix)"
        ),
        _DECODER_SUBCLASS.format(body="    def f(self):\n        self._split_mla = 1"),
        "def f(model):\n    return model.sites, getattr(model, 'expert_parallel', None)",
        "class Own:\n    def _moe(self):\n        return self._moe",  # not a subclass
    ],
)
def test_public_members_and_own_privates_are_allowed(source: str) -> None:
    members = _all_private_members()
    assert member_violations(source, "grpo", members, "scratch.py") == []
