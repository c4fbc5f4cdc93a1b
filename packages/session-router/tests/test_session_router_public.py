"""The public surface of posttrain.session_router is exactly ``__all__``."""

from __future__ import annotations

import pytest

import posttrain.session_router as sr


def test_all_is_exactly_the_public_surface() -> None:
    assert len(sr.__all__) == len(set(sr.__all__))
    assert set(sr.__all__) == set(sr._EXPORTS)  # every public name loads lazily from its module
    for name in sr.__all__:
        assert getattr(sr, name) is not None
    # once loaded, nothing else from posttrain sits in the package namespace
    public = {
        name
        for name, value in vars(sr).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("posttrain.")
    }
    public |= {"ROUTING_KEY_HEADER"}
    assert set(sr.__all__) == public
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        sr.not_a_name  # noqa: B018


def test_error_tree_is_rooted_in_posttrain_error() -> None:
    from posttrain.interface import PosttrainError, TransportError

    for name in (
        "SessionRouterError",
        "RouterIncompatible",
        "SessionNotFoundError",
        "BadChatRequestError",
        "TitoMismatchError",
        "SampleAssemblyError",
    ):
        assert issubclass(getattr(sr, name), sr.SessionRouterError)
    assert issubclass(sr.SessionRouterError, PosttrainError)
    assert issubclass(sr.UpstreamReplyError, TransportError)
    assert issubclass(sr.RouterStartError, TransportError)
    assert issubclass(sr.UpstreamTimeoutError, sr.UpstreamTransportError)
    assert issubclass(sr.UpstreamTimeoutError, TransportError)
