"""The public surface is exactly ``__all__``, and importing the interface pulls in nothing heavy."""

from __future__ import annotations

import subprocess
import sys
import types

import posttrain.interface as interface
from posttrain.interface import processes, testing


def _public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", module.__name__).startswith("posttrain.interface")
    } | {name for name in vars(module) if name.isupper() and not name.startswith("_")}


def test_all_is_exactly_the_public_surface() -> None:
    assert set(interface.__all__) == _public_names(interface)
    assert len(interface.__all__) == len(set(interface.__all__))
    for name in interface.__all__:
        assert getattr(interface, name) is not None


def test_testing_module_all_is_its_public_surface() -> None:
    public = {
        name
        for name, value in vars(testing).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", "").startswith("posttrain.interface")
    }
    assert set(testing.__all__) == public


def test_processes_module_all_is_its_public_surface() -> None:
    public = {
        name
        for name, value in vars(processes).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", None) == processes.__name__
    } | {"DEFAULT_PRELOAD", "StartMethod"}
    assert set(processes.__all__) == public


def test_import_loads_neither_torch_nor_httpx() -> None:
    code = (
        "import sys, posttrain.interface\n"
        "heavy = [m for m in ('torch', 'httpx', 'numpy', 'safetensors') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_error_tree_is_documented_once() -> None:
    doc = interface.__doc__ or ""
    for name in interface.__all__:
        value = getattr(interface, name)
        if isinstance(value, type) and issubclass(value, interface.PosttrainError):
            assert name in doc, f"{name} is missing from the error tree docstring"
