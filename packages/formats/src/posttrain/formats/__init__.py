"""posttrain.formats: every format two posttrain packages exchange, implemented once.

Each format lives here in both directions (write and read), so the two packages that exchange
it cannot drift apart. Depends only on ``posttrain-interface``, torch, safetensors (with numpy)
and httpx (for the one client it owns).

- LoRA request fields: ``LoraServing``, ``serves_lora``, ``request_fields(name, version)``
  (``lora_path`` + ``extra_key``) and ``apply_lora_fields``, the one writer of those keys.
- samples/1: ``encode_samples`` / ``decode_samples`` (numpy + safetensors; no server, no torch).
- wsync/1: ``pack_bucket`` / ``unpack_bucket`` (256-byte aligned offsets),
  ``encode_bucket_body`` / ``decode_bucket_body`` (a bucket over HTTP), and the trainer-side
  ``WeightSink`` client ``WeightPushClient`` with ``push_weights`` and ``ShmRing``.

Importing the package is light: the wsync/1 names load their modules (and torch) on first use
(PEP 562), so a session server that needs only the LoRA fields and samples/1 never imports torch.

Error tree (rooted in ``posttrain.interface.PosttrainError``)::

    FormatsError                     a payload, file or request in one of our formats is invalid
    ├── FormatsConfigError (ConfigError)      a bad argument: adapter name, bucket size, ring
    ├── SamplesFormatError (WireFormatError)  a samples/1 payload is malformed (.field)
    └── BucketFormatError (WireFormatError)   a wsync/1 bucket disagrees with its manifest
                                              or its bytes (.field)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from posttrain.formats._errors import (
    BucketFormatError,
    FormatsConfigError,
    FormatsError,
    SamplesFormatError,
)
from posttrain.formats._lora_fields import (
    LoraServing,
    apply_lora_fields,
    request_fields,
    serves_lora,
)
from posttrain.formats._samples_wire import (
    SAMPLES_FORMAT,
    DecodedSamples,
    decode_samples,
    encode_samples,
)

if TYPE_CHECKING:
    from posttrain.formats._buckets import (
        DTYPES,
        decode_bucket_body,
        dtype_from_name,
        dtype_name,
        encode_bucket_body,
        expected_tensors,
        pack_bucket,
        plan_buckets,
        safetensors_metadata,
        tensors_sha256,
        unpack_bucket,
    )
    from posttrain.formats._weight_push import ShmRing, WeightPushClient, push_weights

# The wsync/1 names need torch: their modules load on first use of a name.
_NEEDS_TORCH = {
    "_buckets": (
        "DTYPES",
        "decode_bucket_body",
        "dtype_from_name",
        "dtype_name",
        "encode_bucket_body",
        "expected_tensors",
        "pack_bucket",
        "plan_buckets",
        "safetensors_metadata",
        "tensors_sha256",
        "unpack_bucket",
    ),
    "_weight_push": ("ShmRing", "WeightPushClient", "push_weights"),
}

__all__ = [
    "DTYPES",
    "SAMPLES_FORMAT",
    "BucketFormatError",
    "DecodedSamples",
    "FormatsConfigError",
    "FormatsError",
    "LoraServing",
    "SamplesFormatError",
    "ShmRing",
    "WeightPushClient",
    "apply_lora_fields",
    "decode_bucket_body",
    "decode_samples",
    "dtype_from_name",
    "dtype_name",
    "encode_bucket_body",
    "encode_samples",
    "expected_tensors",
    "pack_bucket",
    "plan_buckets",
    "push_weights",
    "request_fields",
    "safetensors_metadata",
    "serves_lora",
    "tensors_sha256",
    "unpack_bucket",
]


def __getattr__(name: str) -> Any:
    module = next((m for m, names in _NEEDS_TORCH.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
