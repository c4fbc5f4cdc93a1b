"""The root of every error posttrain raises.

Each package defines its own subclasses (named in that package's docstring);
the tree below lists the ones the interface itself defines.

    PosttrainError                    base of every posttrain error
    ├── ConfigError (ValueError)      a spec or option is invalid (names the field and value)
    ├── WireFormatError (ValueError)  a wire payload fails validation (names the field)
    ├── TransportError                an HTTP peer could not be reached or answered badly
    │   └── EngineError               an engine answered with an error status or success=false
    ├── WeightSyncError               a weight update did not complete
    │   ├── IncompleteUpdateError     missing, unknown or duplicate tensors in an update
    │   └── StaleVersionError         a weight version that does not increase
    └── ProcessError                  a child process hung, crashed, raised or never became ready
        ├── ServerStartError          a server exited or did not answer ready in time
        └── WorkerError               a rank of a worker group failed (.rank)
            ├── WorkerTimeoutError (TimeoutError)  ranks did not finish in time (all killed)
            ├── WorkerCrashedError    a rank exited without reporting a result
            └── WorkerFailedError     a rank raised (its traceback is in the message)
"""

from __future__ import annotations


class PosttrainError(Exception):
    """Base class of every error raised by a posttrain package."""


class ConfigError(PosttrainError, ValueError):
    """A spec, option or argument is invalid; the message names the field and value."""


class WireFormatError(PosttrainError, ValueError):
    """A wire payload failed validation; ``field`` is the dotted path of the bad field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TransportError(PosttrainError):
    """An HTTP peer could not be reached, timed out, or answered with a malformed reply."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class EngineError(TransportError):
    """An engine answered with an error status or ``success: false``."""

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None) -> None:
        super().__init__(message, url=url)
        self.status = status


class WeightSyncError(PosttrainError):
    """A weight update did not complete."""


class IncompleteUpdateError(WeightSyncError):
    """An update's tensors were missing, unknown, duplicated or of the wrong dtype/shape."""


class StaleVersionError(WeightSyncError):
    """A weight version did not increase over the engine's current version."""


class ProcessError(PosttrainError):
    """A child process hung, crashed, raised or never became ready."""


class ServerStartError(ProcessError):
    """A server process exited or did not answer ready in time; the message says which."""


class WorkerError(ProcessError, RuntimeError):
    """A rank of a worker group failed; ``rank`` is the rank at fault (the first, for a group)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class WorkerTimeoutError(WorkerError, TimeoutError):
    """Ranks did not finish within the group's timeout (a hang); every rank was killed."""


class WorkerCrashedError(WorkerError):
    """A rank exited (a non-zero code or a signal) without reporting a result."""


class WorkerFailedError(WorkerError):
    """A rank raised; the message carries its traceback."""
