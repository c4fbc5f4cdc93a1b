"""Build a served model from a checkpoint directory, dequantizing NVFP4 checkpoints.

A plain directory (``config.json`` + safetensors in the HF Qwen3-MoE layout) loads
through ``posttrain.models``. A directory with an NVFP4 ``quantization_config`` (or
``hf_quant_config.json``) is read through ``posttrain.formats``' NVFP4 format (the one
``quant-convert`` writes and SGLang loads): its quantized linears are dequantized to the
dtype the model keeps them in, and the report says which, under ``/server_info``.

Departure from a GPU engine: there is no FP4 arithmetic here. The dequantized weights are
exactly the values an NVFP4 kernel multiplies by (up to one rounding to the model dtype),
so quantization drift in logprobs can be studied on CPU; activation quantization
(``input_scale``) is not simulated, and the report says so.

Whatever a checkpoint holds is untrusted bytes: a missing or unreadable file, a truncated
or garbage safetensors file, a malformed index and NaN/Inf weights all become a
``CheckpointError`` (or ``NonFiniteWeightsError``) naming the directory, never a raw
``SafetensorError`` or ``OSError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from posttrain.formats import (
    GROUP_SIZE,
    check_finite,
    dequantize_nvfp4_state_dict,
    read_nvfp4_quant_config,
)
from posttrain.formats import NVFP4FormatError as FormatsNVFP4Error
from posttrain.local_engine._errors import CheckpointError, NonFiniteWeightsError, NVFP4FormatError
from posttrain.models import DecoderModel, ModelsError, Numerics, load_config, load_hf_tensors

__all__ = ["NVFP4Report", "load_model", "read_checkpoint"]


@dataclass(slots=True, kw_only=True)
class NVFP4Report:
    """What was dequantized; served verbatim under /server_info ``quantization_report``."""

    quant_algo: str = "NVFP4"
    group_size: int = GROUP_SIZE
    exclude_modules: list[str] = field(default_factory=list)
    kv_cache_quant_algo: str | None = None
    dequantized: list[str] = field(default_factory=list)
    activation_quantization: str = "not simulated (input_scale ignored)"
    wire: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    """The checkpoint's own NVFP4 tensors (packed codes, scales) by name: what a weight update
    sends for a dequantized weight, as it would to an SGLang ``modelopt_fp4`` engine."""

    def to_json(self) -> dict[str, Any]:
        return {
            "quant_algo": self.quant_algo,
            "group_size": self.group_size,
            "exclude_modules": list(self.exclude_modules),
            "kv_cache_quant_algo": self.kv_cache_quant_algo,
            "dequantized_tensors": len(self.dequantized),
            "dequantized_to": "model parameter dtype, via fp32",
            "compute": "CPU dequantized weights; no FP4 kernels",
            "activation_quantization": self.activation_quantization,
        }


def read_checkpoint(
    model_dir: str | Path, specs: dict[str, torch.dtype]
) -> tuple[dict[str, torch.Tensor], NVFP4Report | None]:
    """All base tensors of a checkpoint under HF names (dequantized if NVFP4).

    ``specs`` maps each weight name the model holds to its dtype (the dequantized dtype).
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"model_path {str(d)!r} is not a directory")
    config_file = d / "config.json"
    try:  # a plain checkpoint's broken config.json is a checkpoint error, not an NVFP4 one
        json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        why = "missing or unreadable" if isinstance(e, OSError) else "not valid JSON"
        raise CheckpointError(f"{config_file}: {why}") from None
    try:
        declared = read_nvfp4_quant_config(d)
        tensors = load_hf_tensors(d)
        wire: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        if declared is not None:
            raw = tensors
            tensors, done = dequantize_nvfp4_state_dict(tensors, dtypes=specs)
            modules = {n.removesuffix(".weight") for n in done}
            wire = {
                k: (t.dtype, tuple(t.shape))
                for k, t in raw.items()
                if k.rsplit(".", 1)[0] in modules
            }
    except FormatsNVFP4Error as e:
        raise NVFP4FormatError(str(e)) from e
    except ModelsError as e:
        raise CheckpointError(f"{d}: {e}") from e
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        # SafetensorError: truncated or garbage file; ValueError: a malformed index JSON;
        # KeyError/TypeError: an index of the wrong shape.
        raise CheckpointError(f"{d}: unreadable checkpoint ({type(e).__name__}: {e})") from e
    # The one NaN/Inf scan of a checkpoint, at start and for /update_weights_from_disk alike.
    check_finite(
        sorted(tensors.items()), what=f"checkpoint {str(d)!r}", error=NonFiniteWeightsError
    )
    if declared is None:
        return tensors, None
    report = NVFP4Report(
        exclude_modules=list(declared.exclude_modules),
        kv_cache_quant_algo=declared.kv_cache_quant_algo,
        dequantized=list(done),
        wire=wire,
    )
    return tensors, report


def load_model(
    model_dir: str | Path, *, numerics: str = "strict", context_length: int | None = None
) -> tuple[DecoderModel, NVFP4Report | None]:
    """The model of a checkpoint directory, ready to serve; ``context_length`` is its KV
    capacity (``ModelConfig.kv_capacity``; None keeps ``max_position_embeddings``)."""
    try:
        config = load_config(model_dir)
        if context_length is not None:
            config = config.replace(kv_capacity=context_length)
        model = DecoderModel(config, numerics=Numerics(numerics))
    except ModelsError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    specs = {k: v.dtype for k, v in model.hf_state_dict().items()}
    tensors, report = read_checkpoint(model_dir, specs)
    try:
        model.load_hf_state_dict(tensors)
    except ModelsError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    model.eval()
    return model, report
