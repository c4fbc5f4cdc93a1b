"""The public surface is exactly ``__all__``, and every error sits in the documented tree."""

from __future__ import annotations

import types

import posttrain.formats as formats
from posttrain.interface import PosttrainError


def _public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_all_is_exactly_the_public_surface() -> None:
    assert set(formats.__all__) == _public_names(formats)
    assert len(formats.__all__) == len(set(formats.__all__))
    for name in formats.__all__:
        assert getattr(formats, name) is not None


def test_error_tree_is_documented_once() -> None:
    doc = formats.__doc__ or ""
    errors = [
        name
        for name in formats.__all__
        if isinstance(getattr(formats, name), type)
        and issubclass(getattr(formats, name), PosttrainError)
    ]
    assert len(errors) >= 5
    for name in errors:
        assert name in doc, f"{name} is missing from the error tree docstring"
        assert issubclass(getattr(formats, name), formats.FormatsError)
