"""``__all__`` is exactly the public surface of posttrain.launch."""

import posttrain.launch as launch


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name
        for name in vars(launch)
        if not name.startswith("_")
        and not isinstance(getattr(launch, name), type(launch))  # submodules are not API
    }
    assert set(launch.__all__) == public
    assert len(launch.__all__) == len(set(launch.__all__))


def test_every_exported_name_resolves() -> None:
    for name in launch.__all__:
        assert getattr(launch, name) is not None, name
