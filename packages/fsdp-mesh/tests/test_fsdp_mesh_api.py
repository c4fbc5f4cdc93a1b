"""The public surface of posttrain.fsdp_mesh is exactly ``__all__``."""

from __future__ import annotations

import posttrain.fsdp_mesh as fm


def test_all_is_the_public_surface() -> None:
    public = {n for n in dir(fm) if not n.startswith("_")}
    # Submodules are attributes of the package once imported; they are not API names.
    public -= {"parity"}
    assert set(fm.__all__) == public
    assert len(fm.__all__) == len(set(fm.__all__))


def test_error_tree_roots_in_the_interface() -> None:
    from posttrain.interface import PosttrainError

    for name in fm.__all__:
        obj = getattr(fm, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, fm.FsdpMeshError)
            assert issubclass(obj, PosttrainError)
