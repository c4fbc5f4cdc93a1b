"""Errors raised by ``posttrain.models``.

Every error names the field, tensor or file at fault. The tree (rooted in the
interface's base error):

    PosttrainError
    ├── ConfigError (ValueError)
    │   └── ModelConfigError              a ModelConfig field or a config.json value is invalid
    └── ModelsError                       base of the errors below
        ├── CheckpointError               a checkpoint directory or file is missing or malformed
        ├── TensorSpecError               the set or the specs of tensors do not match the model
        │   ├── UnknownTensorError        a tensor name the model does not have
        │   ├── MissingTensorError        a tensor the model needs was not given
        │   ├── DuplicateTensorError      a tensor was given (or consumed) twice
        │   └── TensorSpecMismatchError   a tensor has the wrong shape or dtype (dtype is never cast)
        ├── ModelInputError (ValueError)  bad token ids or segment lengths given to a forward
        ├── MediaError (ValueError)       media that cannot be decoded or does not fit the model
        ├── CacheError                    a KV-cache row is full, unknown, or used out of order
        └── LoraError                     an adapter names an unknown layer or has bad shapes
"""

from __future__ import annotations

from posttrain.interface import ConfigError, PosttrainError


class ModelConfigError(ConfigError):
    """A ModelConfig field or a ``config.json`` value is invalid; the message names the field."""


class ModelsError(PosttrainError):
    """Base class of the runtime errors of ``posttrain.models``."""


class CheckpointError(ModelsError):
    """A checkpoint directory or file is missing or malformed; the message names the path."""


class TensorSpecError(ModelsError):
    """The names, shapes or dtypes of given tensors do not match the model."""


class UnknownTensorError(TensorSpecError):
    """A tensor name that the model (or the layout being converted) does not have."""


class MissingTensorError(TensorSpecError):
    """A tensor the model needs was not given."""


class DuplicateTensorError(TensorSpecError):
    """A tensor was given or consumed more than once."""


class TensorSpecMismatchError(TensorSpecError):
    """A tensor has the wrong shape or dtype. Dtypes are never cast silently (guarantee G1)."""


class ModelInputError(ModelsError, ValueError):
    """Token ids out of the vocabulary, or segment lengths that do not fit the input or capacity."""


class MediaError(ModelsError, ValueError):
    """A media reference that does not decode, a media item the model has no tower for or whose
    shape does not fit it, or sentinels and media items that do not pair up.

    ``kind`` is ``"image"`` or ``"audio"`` when the error concerns one kind (so an HTTP layer
    can name ``image_data`` or ``audio_data``), else None.
    """

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class CacheError(ModelsError):
    """A KV-cache row is full, out of range, or extended with a mismatching batch."""


class LoraError(ModelsError):
    """An adapter names a layer the model does not have, or its matrices have the wrong shapes."""
