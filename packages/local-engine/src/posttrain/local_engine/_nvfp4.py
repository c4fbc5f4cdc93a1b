"""Load NVFP4 (ModelOpt layout) checkpoints by dequantizing them for CPU compute.

Layout read (the one ``quant-convert`` writes and SGLang loads): for a quantized
linear ``P``, ``P.weight`` is uint8 ``[N, K/2]`` (two E2M1 codes per byte, the even
element in the low nibble), ``P.weight_scale`` is float8_e4m3fn ``[N, K/16]`` (one
scale per 1x16 block, row-major), ``P.weight_scale_2`` is a float32 scalar (``[E]``
for stacked 3-D experts) and ``P.input_scale`` is optional. The value is
``E2M1[c] * (float(s) * weight_scale_2)`` in fp32, then rounded once to the dtype
the model keeps that weight in.

Departure from a GPU engine: there is no FP4 arithmetic here. The dequantized
weights reproduce exactly the values an NVFP4 kernel multiplies by (up to that one
rounding to the model dtype), so quantization drift in logprobs can be studied on
CPU; activation quantization (``input_scale``) is not simulated, and /server_info
says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.local_engine._errors import NVFP4FormatError

__all__ = [
    "E2M1_VALUES",
    "NVFP4Report",
    "dequantize_nvfp4",
    "dequantize_state_dict",
    "read_quant_config",
    "unpack_e2m1",
]

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
GROUP_SIZE = 16


@dataclass(slots=True, kw_only=True)
class NVFP4Report:
    """What was dequantized; served verbatim under /server_info ``quantization_report``."""

    quant_algo: str = "NVFP4"
    group_size: int = GROUP_SIZE
    exclude_modules: list[str] = field(default_factory=list)
    kv_cache_quant_algo: str | None = None
    dequantized: list[str] = field(default_factory=list)
    compute_dtype: str = "float32"
    activation_quantization: str = "not simulated (input_scale ignored)"

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


def read_quant_config(model_dir: Path) -> NVFP4Report | None:
    """The NVFP4 settings of a checkpoint, or None if it is not NVFP4-quantized.

    ``config.json``'s ``quantization_config`` is read first, then ``hf_quant_config.json``
    (the order SGLang uses). A quant_algo other than NVFP4 raises.
    """
    qc: dict[str, Any] | None = None
    cfg_path = model_dir / "config.json"
    if cfg_path.is_file():
        qc = json.loads(cfg_path.read_text()).get("quantization_config")
    if not qc:
        hf_path = model_dir / "hf_quant_config.json"
        if hf_path.is_file():
            qc = json.loads(hf_path.read_text()).get("quantization")
    if not qc:
        return None
    algo = str(qc.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise NVFP4FormatError(
            f"{model_dir}: quant_algo {qc.get('quant_algo')!r} is not supported (only NVFP4)"
        )
    group = int(qc.get("group_size", GROUP_SIZE))
    if group != GROUP_SIZE:
        raise NVFP4FormatError(f"{model_dir}: NVFP4 group_size {group}, expected {GROUP_SIZE}")
    exclude = qc.get("exclude_modules", qc.get("ignore")) or []
    return NVFP4Report(
        group_size=group,
        exclude_modules=[str(x) for x in exclude],
        kv_cache_quant_algo=qc.get("kv_cache_quant_algo"),
    )


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., K/2]`` codes to fp32 ``[..., K]`` values (low nibble = even element)."""
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return E2M1_VALUES[codes]


def dequantize_nvfp4(
    name: str, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor
) -> torch.Tensor:
    """fp32 weight ``[..., N, K]`` from packed codes, E4M3 block scales and the global scale."""
    if packed.dtype != torch.uint8:
        raise NVFP4FormatError(f"{name}.weight: NVFP4 codes must be uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise NVFP4FormatError(f"{name}.weight_scale: must be float8_e4m3fn, got {scale.dtype}")
    k = packed.shape[-1] * 2
    if tuple(scale.shape) != (*packed.shape[:-1], k // GROUP_SIZE) or k % GROUP_SIZE:
        raise NVFP4FormatError(
            f"{name}.weight_scale: shape {list(scale.shape)} does not match codes "
            f"{list(packed.shape)} (expected [..., K/16] with K={k})"
        )
    s2 = scale_2.to(torch.float32)
    if packed.dim() == 3 and s2.numel() == packed.shape[0]:
        s2 = s2.reshape(-1, 1, 1)
    elif s2.numel() != 1:
        raise NVFP4FormatError(
            f"{name}.weight_scale_2: shape {list(scale_2.shape)} is neither a scalar nor [E]"
        )
    block = scale.to(torch.float32) * s2.reshape(s2.shape if s2.dim() == 3 else ())
    values = unpack_e2m1(packed)
    grouped = values.reshape(*values.shape[:-1], k // GROUP_SIZE, GROUP_SIZE)
    return (grouped * block.unsqueeze(-1)).reshape(values.shape)


def dequantize_state_dict(
    tensors: dict[str, torch.Tensor],
    report: NVFP4Report,
    target_dtypes: dict[str, torch.dtype],
) -> dict[str, torch.Tensor]:
    """Replace every NVFP4 group by a dequantized ``.weight``; drop the scale tensors.

    ``target_dtypes`` maps each weight name the model holds to its dtype. A scale
    without its codes (or codes without scales) raises NVFP4FormatError naming it.
    """
    out: dict[str, torch.Tensor] = {}
    scale_suffixes = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")
    prefixes = {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")}
    for key, t in tensors.items():
        if key.endswith(scale_suffixes):
            base = key.rsplit(".", 1)[0]
            if (
                key.endswith((".weight_scale", ".weight_scale_2"))
                and base + ".weight" not in tensors
            ):
                raise NVFP4FormatError(f"{key}: scale without codes {base}.weight")
            continue
        if key.endswith(".weight") and key[: -len(".weight")] in prefixes:
            prefix = key[: -len(".weight")]
            s2 = tensors.get(prefix + ".weight_scale_2")
            if s2 is None:
                raise NVFP4FormatError(f"{prefix}.weight_scale_2: missing for NVFP4 codes {key}")
            w = dequantize_nvfp4(prefix, t, tensors[prefix + ".weight_scale"], s2)
            dtype = target_dtypes.get(key, torch.bfloat16)
            out[key] = w.to(dtype)
            report.dequantized.append(key)
            continue
        if t.dtype == torch.uint8 and key.endswith(".weight"):
            raise NVFP4FormatError(f"{key}: uint8 weight without {key}_scale (NVFP4 codes alone)")
        out[key] = t
    return out
