"""The errors of ``posttrain.formats``: one subtree per format, rooted in the interface's base.

    PosttrainError (posttrain.interface)
    └── FormatsError                 a payload, file or request in one of our formats is invalid
        ├── FormatsConfigError (ConfigError)      a bad argument: adapter name, bucket size, ring
        ├── SamplesFormatError (WireFormatError)  a samples/1 payload is malformed (.field)
        ├── BucketFormatError (WireFormatError)   a bucket's names, dtypes and shapes disagree
        │                                         (.field)
        ├── NamedTensorsError (WireFormatError)   a serialized-named-tensors payload is not
        │                                         plain named tensors (refused unread)
        ├── UpdateGroupError                      a weight-update group cannot be formed or a
        │                                         broadcast in it failed
        ├── AdapterPayloadError (WireFormatError) an adapter push body is malformed, or a
        │                                         tensor disagrees with its checksum (.field)
        ├── NVFP4FormatError         an NVFP4 tensor group (weight, weight_scale, weight_scale_2)
        │   (ValueError)             or an NVFP4 quant config is malformed
        └── PeftFormatError          a PEFT LoRA adapter is malformed
            (ValueError)
            ├── PeftConfigError      adapter_config.json: unreadable, not a JSON object, a field
            │                        missing or invalid (r <= 0, peft_type, bias, DoRA, ...), or
            │                        target_modules that do not select the tensors present
            └── PeftTensorError      adapter_model.safetensors: unreadable or corrupt, a key that
                │                    is not a PEFT LoRA key, a non-float dtype, a shape
                │                    inconsistent with r, lora_A without lora_B (or the reverse)
                └── PeftNonFiniteError   a factor holds NaN or Inf

An engine answering a weight push badly raises the interface's ``EngineError``,
naming the engine, the route and SGLang's message (``EngineClient``).

Atomic writes raise the operating system's ``OSError`` (disk full, permission): the caller
knows which of its files that was and maps it to its own error; the target is left as it was.
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
    """A bucket's tensors and its names, dtypes or shapes disagree; ``field`` names which."""


class NamedTensorsError(FormatsError, WireFormatError):
    """A serialized-named-tensors payload holds something other than plain named tensors."""


class UpdateGroupError(FormatsError):
    """A weight-update group cannot be formed (rendezvous, backend) or a broadcast failed."""


class AdapterPayloadError(FormatsError, WireFormatError):
    """An adapter push body is malformed or a tensor fails its checksum; ``field`` names which."""


class NVFP4FormatError(FormatsError, ValueError):
    """An NVFP4 tensor group or quant config is malformed; the message names the tensor or file."""


class PeftFormatError(FormatsError, ValueError):
    """A PEFT LoRA adapter is malformed; the message names the file, key or field."""


class PeftConfigError(PeftFormatError):
    """``adapter_config.json`` (or a config dict sent on the wire) is invalid; names the field."""


class PeftTensorError(PeftFormatError):
    """The adapter's tensors (or their safetensors file) are invalid; names the file and key."""


class PeftNonFiniteError(PeftTensorError):
    """A factor holds NaN or Inf; the message names the file and key."""
