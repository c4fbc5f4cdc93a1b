"""Errors raised by ``posttrain.models.context_parallel`` (a branch of the models error tree).

PosttrainError
├── ConfigError (ValueError)
│   └── ModelConfigError
│       └── ContextParallelConfigError    a CP/SP size, layout, kernel size, window or scale is bad
└── ModelsError
    └── ContextParallelError              base of the runtime errors below
        ├── SequenceLayoutError (ValueError)   segment lengths do not fit the layout
        ├── ShardShapeError (ValueError)       a local tensor does not match this rank's shard
        ├── ProcessGroupMismatchError          the process group does not match the sharding
        └── UnsupportedModelError (TypeError)  a model the context-parallel forward cannot run
"""

from __future__ import annotations

from posttrain.models._errors import ModelConfigError, ModelsError


class ContextParallelConfigError(ModelConfigError):
    """A CP/SP size, layout, kernel size, window, extent or softmax scale is invalid."""


class ContextParallelError(ModelsError):
    """Base class of the runtime errors of context and sequence parallelism."""


class SequenceLayoutError(ContextParallelError, ValueError):
    """Segment lengths (or cu_seqlens) that the layout cannot split, naming the segment."""


class ShardShapeError(ContextParallelError, ValueError):
    """A tensor whose rows or shape do not match this rank's shard, naming the tensor."""


class ProcessGroupMismatchError(ContextParallelError):
    """The process group's size or this rank's membership does not match the sharding."""


class UnsupportedModelError(ContextParallelError, TypeError):
    """A model (or parameter kind) the model-level context-parallel helpers cannot handle."""
