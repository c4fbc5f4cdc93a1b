"""Check the model shape a launch plan declares against the checkpoint's ``config.json``.

Megatron-style plans carry ``--num-layers``, ``--num-experts`` and ``--moe-layer-freq``. The
fsdp backend builds the model from the checkpoint, so these flags are not inputs; they are
claims, and a claim that disagrees with the checkpoint is an error rather than a silent
no-op. The layer pattern is read the way HF reads it: ``mlp_layer_types`` when present, else
DeepSeek/GLM's ``first_k_dense_replace``, else Qwen3-MoE's ``decoder_sparse_step`` and
``mlp_only_layers``. A ``model_path`` that is not a local directory with a ``config.json``
(a hub id in a dry run) cannot be checked here and is left to the loop, which loads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.grpo._errors import GrpoConfigError
from posttrain.grpo.config import GrpoConfig

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def check_declared_shape(config: GrpoConfig) -> bool:
    """Raise ``GrpoConfigError`` if a declared shape flag disagrees with the checkpoint.

    Returns True when a ``config.json`` was read (something was checked), False otherwise.
    """
    declared = (config.num_layers, config.num_experts, config.moe_layer_freq)
    if config.model_path is None or all(v is None for v in declared):
        return False
    path = Path(config.model_path) / "config.json"
    if not path.is_file():
        return False
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GrpoConfigError(f"model_path: cannot read {path}: {exc}") from None
    if not isinstance(hf, dict):
        raise GrpoConfigError(f"model_path: {path} does not hold a JSON object")
    layers = hf.get("num_hidden_layers")
    experts = next((hf[k] for k in _EXPERT_KEYS if hf.get(k) is not None), 0)
    if config.num_layers is not None and config.num_layers != layers:
        raise GrpoConfigError(
            f"num_layers={config.num_layers} but {path} has num_hidden_layers={layers}"
        )
    if config.num_experts is not None and config.num_experts != experts:
        raise GrpoConfigError(f"num_experts={config.num_experts} but {path} has {experts} experts")
    pattern = _moe_layers(hf, layers, experts)
    if config.moe_layer_freq is not None and pattern is not None:
        declared_freq = list(config.moe_layer_freq)
        if declared_freq != pattern:
            raise GrpoConfigError(
                f"moe_layer_freq={declared_freq} but {path} has MoE layers {pattern}"
            )
    return True


def _moe_layers(hf: dict[str, Any], layers: object, experts: object) -> list[int] | None:
    """One 0/1 entry per layer (1: MoE), or None when the config does not say."""
    if not isinstance(layers, int) or not isinstance(experts, int):
        return None
    types = hf.get("mlp_layer_types")
    if isinstance(types, list):
        return [1 if t in ("moe", "sparse") else 0 for t in types]
    if not experts:
        return [0] * layers
    first_dense = hf.get("first_k_dense_replace")
    if isinstance(first_dense, int):
        return [0 if i < first_dense else 1 for i in range(layers)]
    step = hf.get("decoder_sparse_step")
    if isinstance(step, int) and step > 0:
        dense = set(hf.get("mlp_only_layers") or [])
        return [1 if i not in dense and (i + 1) % step == 0 else 0 for i in range(layers)]
    return None
