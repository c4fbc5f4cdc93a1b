"""The errors posttrain.launch raises, written out once.

    PosttrainError (posttrain.interface)
    └── LaunchError                          base of every launch error
        ├── LaunchConfigError (ConfigError)  a model, hardware, flag or option is invalid;
        │   │                                names the field and the value at fault
        │   └── UnsupportedHardwareError     no rule covers this (hardware, nodes) pair; names both
        ├── ReadinessError (TransportError)  a started process did not answer its readiness URL
        │                                    in time; names the process and the URL
        ├── ProcessFailedError               a started process exited while the stack was coming
        │                                    up or running; names the process, pid and exit code
        └── RecipeError                      ``posttrain grpo``'s recipe could not be prepared,
                                             or the trainer's dry run refused it; names the step
                                             and the trainer's error line

(``posttrain.grpo.GrpoRunError`` is the trainer's own: a run step that failed inside it.)

``HardwareMismatchWarning`` (a ``UserWarning``) is what ``detect_hardware`` emits when the
detected GPUs disagree with the declared hardware: detection never overrides a declaration.
"""

from __future__ import annotations

from posttrain.interface import ConfigError, PosttrainError, TransportError


class LaunchError(PosttrainError):
    """Base class of every error raised by posttrain.launch."""


class LaunchConfigError(LaunchError, ConfigError):
    """A model id, hardware, flag or option is invalid; the message names field and value."""


class UnsupportedHardwareError(LaunchConfigError):
    """No rule covers this (hardware, nodes) pair for the model; the message names both."""

    def __init__(self, message: str, *, hardware: str, nodes: int) -> None:
        super().__init__(message)
        self.hardware = hardware
        self.nodes = nodes


class ReadinessError(LaunchError, TransportError):
    """A started process did not become ready in time; names the process and the URL."""

    def __init__(self, message: str, *, process: str, url: str | None = None) -> None:
        super().__init__(message, url=url)
        self.process = process


class ProcessFailedError(LaunchError):
    """A started process exited early; names the process, its pid and its exit code."""

    def __init__(self, message: str, *, process: str, pid: int, returncode: int | None) -> None:
        super().__init__(message)
        self.process = process
        self.pid = pid
        self.returncode = returncode


class HardwareMismatchWarning(UserWarning):
    """The detected GPUs disagree with the declared hardware (the declaration still wins)."""


class RecipeError(LaunchError):
    """``posttrain grpo``'s recipe could not be prepared, or the trainer's dry run refused it."""
