"""The errors posttrain.fsdp_mesh raises, all rooted in ``posttrain.interface.PosttrainError``.

    PosttrainError
    └── FsdpMeshError                       base of this package's errors
        ├── MeshConfigError (ConfigError)   a mesh spec / HSDP option is invalid; names the numbers
        ├── MeshBuildError (RuntimeError)   the live process group or built mesh disagrees with the spec
        ├── AccumulationError (RuntimeError) micro-batch bookkeeping that would skip the replicate all-reduce
        ├── CheckpointError                 a checkpoint directory is missing, incomplete or mismatched
        └── ParityError (AssertionError)    a parity check failed; names the check, tensor and rank

A rank of the parity command that hangs, crashes or raises is reported by the one multi-rank
launcher, ``posttrain.interface.processes.run_workers``, as the interface's ``WorkerError``.

Every message names the rank, tensor, field or number at fault.
"""

from __future__ import annotations

from posttrain.interface import ConfigError, PosttrainError


class FsdpMeshError(PosttrainError):
    """Base class of every error raised by posttrain.fsdp_mesh."""


class MeshConfigError(FsdpMeshError, ConfigError):
    """A mesh spec or HSDP option is invalid (raised before any process group exists)."""


class MeshBuildError(FsdpMeshError, RuntimeError):
    """The live process group, or the mesh torch built, disagrees with the spec."""


class AccumulationError(FsdpMeshError, RuntimeError):
    """Gradient-accumulation bookkeeping that would skip or repeat the replicate all-reduce."""


class CheckpointError(FsdpMeshError):
    """A checkpoint directory is missing, incomplete, or does not match the model."""


class ParityError(FsdpMeshError, AssertionError):
    """A gradient-parity check failed; the message names the check, the tensor and the rank."""
