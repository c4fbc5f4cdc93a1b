"""The errors of ``posttrain.grpo``, rooted in the interface's base.

PosttrainError (posttrain.interface)
└── GrpoError                        a GRPO computation, run or option failed
    ├── GrpoConfigError (ConfigError) an option is invalid; names the field and value
    │   └── GrpoUnsupportedError      a valid option this build cannot honour; names the
    │                                 option and what would honour it
    └── GrpoInputError (ValueError)   a tensor handed to the GRPO math is malformed;
                                      names the tensor and the shapes
"""

from __future__ import annotations

from posttrain.interface import ConfigError, PosttrainError


class GrpoError(PosttrainError):
    """Base of every error ``posttrain.grpo`` raises; the message names what is wrong."""


class GrpoConfigError(GrpoError, ConfigError):
    """An option is invalid (type, range, or a combination); the message names the field.

    ``field``: the ``GrpoConfig`` field at fault, when there is one (the CLI shows its flag).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class GrpoUnsupportedError(GrpoConfigError):
    """A valid option this build cannot honour; ``field`` is the option at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message, field=field)


class GrpoInputError(GrpoError, ValueError):
    """A tensor handed to the GRPO math has the wrong shape, dtype or device."""
