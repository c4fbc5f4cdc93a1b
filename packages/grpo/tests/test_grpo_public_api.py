"""``__all__`` is exactly the public surface of posttrain.grpo, and the error tree holds."""

import posttrain.grpo as grpo
from posttrain.interface import ConfigError, PosttrainError


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name
        for name in vars(grpo)
        if not name.startswith("_") and not isinstance(getattr(grpo, name), type(grpo))
    }
    assert set(grpo.__all__) == public
    assert len(grpo.__all__) == len(set(grpo.__all__))


def test_every_exported_name_resolves() -> None:
    for name in grpo.__all__:
        assert getattr(grpo, name) is not None, name


def test_error_tree() -> None:
    assert issubclass(grpo.GrpoError, PosttrainError)
    assert issubclass(grpo.GrpoConfigError, grpo.GrpoError)
    assert issubclass(grpo.GrpoConfigError, ConfigError)
    assert issubclass(grpo.GrpoUnsupportedError, grpo.GrpoConfigError)
    assert issubclass(grpo.GrpoInputError, grpo.GrpoError)
    assert issubclass(grpo.GrpoInputError, ValueError)
    for name in ("GrpoError", "GrpoConfigError", "GrpoUnsupportedError", "GrpoInputError"):
        assert name in (grpo.__doc__ or "")
