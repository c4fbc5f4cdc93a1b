"""posttrain.fsdp_mesh: validated (replicate x shard) device meshes and hybrid-sharded FSDP2.

Build a mesh from a ``posttrain.interface.MeshSpec`` (``build_fsdp_mesh``), shard a model on it (``apply_hsdp``),
accumulate gradients with one replicate all-reduce per step (``accumulate_gradients``), clip on
the 2-D mesh (``clip_grad_norm``), checkpoint across layouts (``save_checkpoint`` /
``load_checkpoint``; ``save_files_checkpoint`` commits other files the same way), export full weights (``iter_full_state_dict``), and check a cluster with
the parity worker (``run_parity``; ``python -m posttrain.fsdp_mesh.parity``).
"""

from posttrain.fsdp_mesh._accumulate import GradientAccumulation, accumulate_gradients
from posttrain.fsdp_mesh._checkpoint import (
    CheckpointMeta,
    checkpoint_dir,
    latest_step,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    save_files_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from posttrain.fsdp_mesh._clip import clip_grad_norm, grad_norm, scale_grads_to_norm
from posttrain.fsdp_mesh._comm_count import CollectiveCall, CollectiveLog, count_collectives
from posttrain.fsdp_mesh._errors import (
    AccumulationError,
    CheckpointError,
    FsdpMeshError,
    MeshBuildError,
    MeshConfigError,
    ParityError,
)
from posttrain.fsdp_mesh._gather import gather_full_param, iter_full_state_dict
from posttrain.fsdp_mesh._hsdp import HsdpConfig, apply_hsdp, fsdp_modules
from posttrain.fsdp_mesh._mesh import FsdpMesh, build_fsdp_mesh, check_device_type, check_mesh
from posttrain.fsdp_mesh._parity import ParityConfig, ParityModel, ParityReport, run_parity

__all__ = [
    "AccumulationError",
    "CheckpointError",
    "CheckpointMeta",
    "CollectiveCall",
    "CollectiveLog",
    "FsdpMesh",
    "FsdpMeshError",
    "GradientAccumulation",
    "HsdpConfig",
    "MeshBuildError",
    "MeshConfigError",
    "ParityConfig",
    "ParityError",
    "ParityModel",
    "ParityReport",
    "accumulate_gradients",
    "apply_hsdp",
    "build_fsdp_mesh",
    "check_device_type",
    "check_mesh",
    "checkpoint_dir",
    "clip_grad_norm",
    "count_collectives",
    "fsdp_modules",
    "gather_full_param",
    "grad_norm",
    "iter_full_state_dict",
    "latest_step",
    "load_checkpoint",
    "read_meta",
    "run_parity",
    "save_checkpoint",
    "save_files_checkpoint",
    "scale_grads_to_norm",
    "verify_checkpoint",
    "write_manifest",
]
