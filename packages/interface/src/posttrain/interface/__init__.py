"""posttrain.interface: the typed contract every posttrain package exchanges (work in progress)."""

from posttrain.interface._errors import (
    ConfigError,
    EngineError,
    IncompleteUpdateError,
    PosttrainError,
    StaleVersionError,
    TransportError,
    WeightSyncError,
    WireFormatError,
)

__all__ = [
    "ConfigError",
    "EngineError",
    "IncompleteUpdateError",
    "PosttrainError",
    "StaleVersionError",
    "TransportError",
    "WeightSyncError",
    "WireFormatError",
]
