"""The public surface is exactly ``__all__``, and every error sits in the documented tree."""

from __future__ import annotations

import inspect

import posttrain.formats as formats
from posttrain.interface import PosttrainError


def test_all_is_exactly_the_public_surface() -> None:
    own = [
        n
        for n in dir(formats)
        if not n.startswith("_") and not inspect.ismodule(getattr(formats, n))
    ]
    assert sorted(formats.__all__) == own  # dir() is sorted; __all__ lists each name once
    assert all(getattr(formats, name) is not None for name in formats.__all__)


def test_error_tree_is_documented_once() -> None:
    errors = [
        v for v in vars(formats).values() if inspect.isclass(v) and issubclass(v, PosttrainError)
    ]
    assert {e.__name__ for e in errors} >= {
        "FormatsError",
        "NVFP4FormatError",
        "PeftFormatError",
        "PeftConfigError",
        "PeftTensorError",
    }
    for error in errors:
        assert error.__name__ in (formats.__doc__ or ""), f"{error.__name__} is not in the tree"
        assert issubclass(error, formats.FormatsError)
