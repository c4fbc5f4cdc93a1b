"""Build a served model from a checkpoint directory, dequantizing NVFP4 checkpoints.

A plain directory (``config.json`` + safetensors in the HF Qwen3-MoE layout) loads
through ``posttrain.models``. A directory with an NVFP4 ``quantization_config`` (or
``hf_quant_config.json``) has its quantized linears dequantized to the dtype the
model keeps them in; the report says which tensors were dequantized, and the
engine shows it under ``/server_info``.

Whatever a checkpoint holds is untrusted bytes: a missing or unreadable file, a truncated
or garbage safetensors file, a malformed index and NaN/Inf weights all become a
``CheckpointError`` (or ``NonFiniteWeightsError``) naming the directory, never a raw
``SafetensorError`` or ``OSError``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from posttrain.local_engine._errors import CheckpointError
from posttrain.local_engine._finite import check_finite
from posttrain.local_engine._nvfp4 import NVFP4Report, dequantize_state_dict, read_quant_config
from posttrain.models import DecoderModel, ModelsError, Numerics, load_config, load_hf_tensors

__all__ = ["load_model", "read_checkpoint"]


def read_checkpoint(
    model_dir: str | Path, specs: dict[str, torch.dtype]
) -> tuple[dict[str, torch.Tensor], NVFP4Report | None]:
    """All base tensors of a checkpoint under HF names (dequantized if NVFP4)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"model_path {str(d)!r} is not a directory")
    try:
        report = read_quant_config(d)
        tensors = load_hf_tensors(d)
    except ModelsError as e:
        raise CheckpointError(f"{d}: {e}") from e
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        # SafetensorError: truncated or garbage file; ValueError: a malformed index JSON;
        # KeyError/TypeError: an index of the wrong shape.
        raise CheckpointError(f"{d}: unreadable checkpoint ({type(e).__name__}: {e})") from e
    if report is not None:
        tensors = dequantize_state_dict(tensors, report, specs)
    check_finite(sorted(tensors.items()), what=f"checkpoint {str(d)!r}")
    return tensors, report


def load_model(
    model_dir: str | Path, *, numerics: str = "strict"
) -> tuple[DecoderModel, NVFP4Report | None]:
    """The model of a checkpoint directory, ready to serve."""
    try:
        config = load_config(model_dir)
        model = DecoderModel(config, numerics=Numerics(numerics))
    except ModelsError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    specs = {k: v.dtype for k, v in model.hf_state_dict().items()}
    tensors, report = read_checkpoint(model_dir, specs)
    if report is not None:
        report.compute_dtype = str(config.dtype).removeprefix("torch.")
    try:
        model.load_hf_state_dict(tensors)
    except ModelsError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    model.eval()
    return model, report
