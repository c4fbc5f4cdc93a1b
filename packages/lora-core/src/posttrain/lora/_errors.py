"""The errors posttrain.lora raises, all rooted in ``posttrain.interface.PosttrainError``.

    PosttrainError
    └── LoraError                          base of every error in this package
        ├── LoraConfigError (ConfigError)  bad LoRA option: r <= 0, dropout without opt-in,
        │                                  ETP != 1, overlap_grad_reduce on, unknown target
        ├── LayoutError                    a module or group layout this package cannot adapt
        ├── ReplicaMismatchError           a replicated factor differs across its group (names rank)
        ├── ExportError                    empty export, mixed dtypes in one gather batch
        ├── AdapterFormatError             missing / unknown / mis-shaped key in a PEFT adapter,
        │   (also posttrain.formats.       or any problem the formats PEFT reader found (a corrupt
        │    PeftFormatError)              file, NaN, a bad config), whose message it carries
        └── AdapterPushError (EngineError) engine said success=false, checksum mismatch,
            │                              missing capability
            └── ChecksumMismatchError      the engine's checksums differ from ours

Every message names the tensor, field, URL or rank at fault.
"""

from __future__ import annotations

from posttrain.formats import PeftFormatError
from posttrain.interface import ConfigError, EngineError, PosttrainError


class LoraError(PosttrainError):
    """Base class of every error raised by posttrain.lora."""


class LoraConfigError(LoraError, ConfigError):
    """A LoRA option is invalid or unsafe; the message names the field and value."""


class LayoutError(LoraError):
    """A module, shape or process-group layout that this package cannot adapt."""


class ReplicaMismatchError(LoraError):
    """A factor that must be identical across a process group is not (names tensor and rank)."""


class ExportError(LoraError):
    """The adapter could not be assembled (empty, mixed dtypes in one gather batch, ...)."""


class AdapterFormatError(LoraError, PeftFormatError):
    """A PEFT adapter on disk has missing, unknown or mis-shaped keys, or a bad config."""


class AdapterPushError(LoraError, EngineError):
    """An engine refused an adapter (success=false), or lacks a needed capability."""


class ChecksumMismatchError(AdapterPushError):
    """The engine reported checksums that differ from the ones computed here."""
