"""The public surface is exactly ``__all__``, and every error sits in the documented tree."""

from __future__ import annotations

import posttrain.local_engine as le
from posttrain.interface import PosttrainError
from posttrain.local_engine import _errors


def test_all_is_the_public_surface() -> None:
    public = {n for n in dir(le) if not n.startswith("_")}
    assert set(le.__all__) == public
    assert sorted(le.__all__) == le.__all__


def test_every_error_is_in_the_tree_docstring() -> None:
    doc = _errors.__doc__ or ""
    for name in dir(_errors):
        obj = getattr(_errors, name)
        if isinstance(obj, type) and issubclass(obj, PosttrainError):
            assert name in doc, name
