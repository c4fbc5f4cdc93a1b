"""The errors of ``posttrain.formats``: one subtree per format, rooted in the interface's base.

    PosttrainError (posttrain.interface)
    └── FormatsError                 a payload, file or request in one of our formats is invalid
        ├── FormatsConfigError (ConfigError)      a bad argument: adapter name, bucket size, ring
        ├── SamplesFormatError (WireFormatError)  a samples/1 payload is malformed (.field)
        └── BucketFormatError (WireFormatError)   a wsync/1 bucket disagrees with its manifest
                                                  or its bytes (.field)

An engine answering a weight push badly raises the interface's ``EngineError``,
``IncompleteUpdateError`` or ``StaleVersionError`` (the wsync/1 contract names them).
"""

from __future__ import annotations

from posttrain.interface import ConfigError, PosttrainError, WireFormatError


class FormatsError(PosttrainError):
    """Base of every error ``posttrain.formats`` raises; the message names the tensor or field."""


class FormatsConfigError(FormatsError, ConfigError):
    """An argument is invalid (an empty adapter name, a bucket size, a shared-memory ring)."""


class SamplesFormatError(FormatsError, WireFormatError):
    """A samples/1 payload is malformed; ``field`` names the tensor or metadata field."""


class BucketFormatError(FormatsError, WireFormatError):
    """A wsync/1 bucket's bytes, tensors or manifest disagree; ``field`` names which."""
