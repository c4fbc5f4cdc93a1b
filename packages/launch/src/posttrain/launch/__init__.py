"""posttrain.launch: hardware-aware launch plans, runners and the ``posttrain`` CLI.

``build_plan(LaunchConfig(...))`` turns a model id, a declared ``Hardware`` and a node count
into a ``Plan`` (argv lists, env, readiness checks, JSON). Rules per (model family, hardware)
set the flags; ``Plan.explain()`` names the rule behind each flag; user arguments always come
last. ``LocalRunner`` and ``RayRunner`` execute a plan; ``build_local_stack`` is the local
rollout stack of ``posttrain up``. Errors: see ``posttrain.launch._errors``.
"""

from posttrain.launch._errors import (
    HardwareMismatchWarning,
    LaunchConfigError,
    LaunchError,
    ProcessFailedError,
    ReadinessError,
    RecipeError,
    UnsupportedHardwareError,
)
from posttrain.launch.args import Args, Flag
from posttrain.launch.catalog import MODELS, ModelFamily, ModelSpec, get_model
from posttrain.launch.hardware import (
    Detection,
    Generation,
    Hardware,
    Vendor,
    detect_hardware,
    parse_hardware,
    parse_nvidia_smi,
    parse_rocm_smi,
)
from posttrain.launch.plan import Plan, ProcessSpec, Readiness, Registration, Role
from posttrain.launch.planner import build_plan
from posttrain.launch.rules import RULES, LaunchConfig, Rule
from posttrain.launch.runners import DryRun, LocalRunner
from posttrain.launch.stack import LocalStackConfig, build_local_stack
from posttrain.launch.tables import EngineKind, Precision, TrainerBackend

__all__ = [
    "MODELS",
    "RULES",
    "Args",
    "Detection",
    "DryRun",
    "EngineKind",
    "Flag",
    "Generation",
    "Hardware",
    "HardwareMismatchWarning",
    "LaunchConfig",
    "LaunchConfigError",
    "LaunchError",
    "LocalRunner",
    "LocalStackConfig",
    "ModelFamily",
    "ModelSpec",
    "Plan",
    "Precision",
    "ProcessFailedError",
    "ProcessSpec",
    "Readiness",
    "ReadinessError",
    "RecipeError",
    "Registration",
    "Role",
    "Rule",
    "TrainerBackend",
    "UnsupportedHardwareError",
    "Vendor",
    "build_local_stack",
    "build_plan",
    "detect_hardware",
    "get_model",
    "parse_hardware",
    "parse_nvidia_smi",
    "parse_rocm_smi",
]
