"""The public surface of posttrain.session_router is exactly ``__all__``."""

from __future__ import annotations

import posttrain.session_router as sr


def test_all_is_exactly_the_public_surface() -> None:
    public = {
        name
        for name, value in vars(sr).items()
        if not name.startswith("_") and getattr(value, "__module__", "").startswith("posttrain.")
    }
    public |= {"ROUTING_KEY_HEADER"}
    assert set(sr.__all__) == public
    assert len(sr.__all__) == len(set(sr.__all__))
    for name in sr.__all__:
        assert getattr(sr, name) is not None


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
