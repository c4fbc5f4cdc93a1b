"""The errors posttrain.session_router raises, and the HTTP status each maps to.

PosttrainError                              (posttrain.interface)
├── ConfigError (ValueError)                a bad option: tokenizer dir, policy, port
├── TransportError                          (posttrain.interface; has ``.url``)
│   ├── UpstreamReplyError                  502: the engine/router reply lacks what TITO needs
│   ├── UpstreamTransportError              502: the upstream was unreachable or reset the
│   │   │                                   connection
│   │   └── UpstreamTimeoutError            504: the upstream did not answer within
│   │                                       ``upstream_timeout_s`` (``--upstream-timeout-s``)
│   └── RouterStartError                    sgl-router did not become ready, or a worker did
│                                           not register/deregister in time
└── SessionRouterError                      base of the package's own errors
    ├── RouterIncompatible                  the upstream router drops request fields TITO needs
    │                                       (``.dropped`` names them); raised by the startup probe
    ├── SessionNotFoundError                     404: unknown, deleted or expired session id
    ├── BadChatRequestError (ValueError)         400: bad JSON, bad messages (the field is
    │                                       named), illegal rollback
    ├── TitoMismatchError                        500: the prefix invariant broke (``.index`` is the
    │                                       first differing token position)
    └── SampleAssemblyError (ValueError)    422: records cannot be assembled into a sample
"""

from __future__ import annotations

from posttrain.interface import PosttrainError, TransportError


class SessionRouterError(PosttrainError):
    """Base of the errors defined by posttrain.session_router."""


class RouterIncompatible(SessionRouterError):  # noqa: N818 (name fixed by the issue)
    """The upstream router re-serializes requests and drops fields this server depends on."""

    def __init__(self, message: str, *, dropped: list[str]) -> None:
        super().__init__(message)
        self.dropped = dropped


class SessionNotFoundError(SessionRouterError, KeyError):
    """No live session has this id (never created, deleted, or reclaimed by the TTL)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} not found")
        self.session_id = session_id

    def __str__(self) -> str:
        return str(self.args[0])


class BadChatRequestError(SessionRouterError, ValueError):
    """A chat request is malformed or cannot be served against the session's state."""


class TitoMismatchError(SessionRouterError):
    """A new turn's tokens do not extend the session's previous checkpoint."""

    def __init__(self, message: str, *, index: int) -> None:
        super().__init__(message)
        self.index = index


class SampleAssemblyError(SessionRouterError, ValueError):
    """A session's records cannot be assembled into a training sample."""


class UpstreamReplyError(TransportError):
    """The upstream reply is missing logprobs/meta_info, or its lengths disagree."""


class RouterStartError(TransportError):
    """sgl-router did not become ready, or a worker (de)registration did not finish in time."""


class UpstreamTransportError(TransportError):
    """The upstream could not be reached, reset the connection or did not answer in time."""

    def __init__(self, cause: BaseException, *, url: str) -> None:
        self.cause_name = type(cause).__name__
        self.detail = str(cause) or repr(cause)
        super().__init__(f"{self.cause_name}: {self.detail}", url=url)


class UpstreamTimeoutError(UpstreamTransportError):
    """The upstream did not answer within the configured upstream timeout (e.g. a frozen engine)."""

    def __init__(self, *, url: str, timeout_s: float) -> None:
        super().__init__(TimeoutError(f"no reply within {timeout_s:g} s"), url=url)
        self.timeout_s = timeout_s
