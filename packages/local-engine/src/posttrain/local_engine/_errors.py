"""The errors local-engine raises, and the HTTP status each one maps to.

Every error reply is JSON ``{"error": {"message", "type", "field", "code"}}``; ``type`` is the
class name below (stable: clients may branch on it). Besides the tree, three types have no
class: ``NotFound`` (404, no such route), ``MethodNotAllowed`` (405) and ``InternalServerError``
(500, an exception that is a bug rather than bad input; its traceback goes to the server log).

PosttrainError (interface)
├── WireFormatError (interface, ValueError)   a request field is malformed          -> 400
│   └── RequestTooLargeError                  a request exceeds a configured limit  -> 413
├── WeightSyncError (interface)               a weight update failed                -> 400
│   ├── IncompleteUpdateError (interface)     missing/unknown/duplicate/wrong-dtype -> 400
│   ├── StaleVersionError (interface)         weight version does not increase     -> 409
│   └── UpdateSessionError                    no session, wrong update id, bucket out of
│                                             order, sha256 mismatch, bad shm slot  -> 400
└── LocalEngineError                          base of this package's own errors
    ├── CheckpointError (ConfigError)         a checkpoint cannot be loaded (names file/tensor)
    │   └── NVFP4FormatError                  an NVFP4 tensor group or quant config is malformed
    │       (also posttrain.formats.NVFP4FormatError, whose message it carries)
    ├── AdapterError                          a LoRA adapter is invalid (names adapter/tensor)
    │   └── UnknownAdapterError               a request names an adapter not loaded -> 400
    ├── NonFiniteWeightsError (ValueError)    a weight or adapter tensor holds NaN/Inf; the
    │                                         update is refused before anything is swapped -> 400
    ├── UnauthorizedError                     missing or wrong bearer token         -> 401
    ├── OverloadedError                       the request queue is full             -> 503
    └── UnavailableError                      weights are invalid after a failed update,
                                              or generation is paused for an abort  -> 503
"""

from __future__ import annotations

import posttrain.formats as formats
from posttrain.interface import (
    ConfigError,
    PosttrainError,
    WeightSyncError,
    WireFormatError,
)


class RequestTooLargeError(WireFormatError):
    """A request exceeds a configured limit (tokens, batch size or body bytes)."""


class UpdateSessionError(WeightSyncError):
    """A weight-update call does not fit the open session (id, bucket order, checksum, slot)."""


class LocalEngineError(PosttrainError):
    """Base of the errors defined by local-engine itself."""


class CheckpointError(LocalEngineError, ConfigError):
    """A checkpoint directory or file cannot be loaded; the message names the file or tensor."""


class NVFP4FormatError(CheckpointError, formats.NVFP4FormatError):
    """An NVFP4 tensor group or quant config is malformed (the formats reader said which)."""


class AdapterError(LocalEngineError, ValueError):
    """A LoRA adapter is invalid; the message names the adapter and the tensor at fault."""


class UnknownAdapterError(AdapterError):
    """A request names an adapter that is not loaded."""


class NonFiniteWeightsError(LocalEngineError, ValueError):
    """A checkpoint, update bucket or adapter holds NaN or Inf; the message names the tensor."""


class UnauthorizedError(LocalEngineError):
    """A state-changing request lacks the configured bearer token."""


class OverloadedError(LocalEngineError):
    """The request queue is full; the client should retry later."""


class UnavailableError(LocalEngineError):
    """The engine cannot serve: its weights are invalid after a failed update."""
