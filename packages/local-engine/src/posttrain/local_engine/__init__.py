"""posttrain.local_engine: an SGLang-HTTP-compatible engine for ``posttrain.models`` on CPU.

Run it as ``python -m posttrain.local_engine --model-path DIR --port P`` (SGLang's flag
names), or build the ASGI app in-process with ``build_app``. In strict numerics the
logprobs it reports equal the trainer's ``forward_logprobs`` bit for bit, with and
without LoRA adapters and across weight updates. It serves SGLang's own
weight-update routes (the distributed update group over gloo, from disk, LoRA from tensors);
the trainer side (``push_distributed``, ``EngineClient``) and the request bodies are
``posttrain.formats``'.

Error tree: see ``posttrain.local_engine._errors`` (rooted in ``PosttrainError``).
"""

from posttrain.local_engine._app import create_app
from posttrain.local_engine._config import EngineConfig, parse_args
from posttrain.local_engine._errors import (
    AdapterError,
    CheckpointError,
    LocalEngineError,
    NonFiniteWeightsError,
    NVFP4FormatError,
    OverloadedError,
    RequestTooLargeError,
    UnauthorizedError,
    UnavailableError,
    UnknownAdapterError,
    UpdateSessionError,
)
from posttrain.local_engine._server import build_app, serve

__all__ = [
    "AdapterError",
    "CheckpointError",
    "EngineConfig",
    "LocalEngineError",
    "NVFP4FormatError",
    "NonFiniteWeightsError",
    "OverloadedError",
    "RequestTooLargeError",
    "UnauthorizedError",
    "UnavailableError",
    "UnknownAdapterError",
    "UpdateSessionError",
    "build_app",
    "create_app",
    "parse_args",
    "serve",
]
