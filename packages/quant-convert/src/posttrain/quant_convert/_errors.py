"""The errors quant-convert raises, rooted in ``posttrain.interface.PosttrainError``.

    PosttrainError
    └── QuantConvertError                    base of every error below
        ├── QuantInputError (ValueError)     a tensor cannot be quantized: NaN/Inf, K not a
        │                                    multiple of 16, unsupported dtype or rank
        ├── CheckpointError (ValueError)     the source checkpoint cannot be converted: no
        │                                    config.json or safetensors, already quantized,
        │                                    gate without its up, partial FusedMoE exclusion,
        │                                    output-key collision, dst equal to or nested in src
        ├── ResumeError                      a resume found a state written for other inputs or
        │                                    options, or an unreadable state (pass
        │                                    ``overwrite=True`` to start over)
        ├── OutputError                      the save dir cannot be written (read-only, full
        │                                    disk, permissions); nothing half-written is left
        │                                    under a final name, and a rerun resumes
        └── ExclusionError                   an exclusion list would not be decided exactly by
                                             SGLang's ``modelopt_fp4`` matcher

A source file that cannot be read or parsed (a safetensors header that lies about its
length, is not JSON, lacks ``dtype``, has offsets outside the file or disagreeing with
dtype x shape) is a ``CheckpointError`` naming the file and tensor.

Option errors (a bad CLI flag value, start+end layers beyond the model) raise the
interface's ``ConfigError``. Every message names the tensor, file or option at fault.
"""

from __future__ import annotations

from posttrain.interface import PosttrainError


class QuantConvertError(PosttrainError):
    """Base class of every error quant-convert raises."""


class QuantInputError(QuantConvertError, ValueError):
    """A tensor cannot be quantized to NVFP4; the message names the tensor."""


class CheckpointError(QuantConvertError, ValueError):
    """The source checkpoint (or the destination) cannot be used; the message names why."""


class ResumeError(QuantConvertError):
    """A resume found state from different inputs or options."""


class OutputError(QuantConvertError):
    """The destination cannot be written; the message names the path and the OS reason."""


class ExclusionError(QuantConvertError):
    """An exclusion list that SGLang would not decide exactly as intended."""
