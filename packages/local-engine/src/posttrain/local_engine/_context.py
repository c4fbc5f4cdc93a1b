"""What the HTTP routes of one engine share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.local_engine._config import EngineConfig
from posttrain.local_engine._engine import Engine
from posttrain.local_engine._requests import TextCodec

__all__ = ["ServerContext"]


@dataclass(slots=True, kw_only=True)
class ServerContext:
    """What the routes share: config, engine, tokenizer, checkpoint facts."""

    config: EngineConfig
    engine: Engine
    codec: TextCodec | None = None
    model_type: str = "qwen3_moe"
    architectures: list[str] = field(default_factory=lambda: ["Qwen3MoeForCausalLM"])
    quantization: dict[str, Any] | None = None
    load_checkpoint: Callable[[str], dict[str, torch.Tensor]] | None = None
    """Reads a checkpoint directory for ``/update_weights_from_disk``, refusing NaN/Inf
    (``read_checkpoint``); the route checks the result against the served model."""
    started: float = field(default_factory=time.time)
