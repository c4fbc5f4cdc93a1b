"""NVFP4 tensors in the ModelOpt layout: names, dtypes, E2M1 packing and dequantization.

The layout SGLang's ``modelopt_fp4`` loader reads, and ``quant-convert`` writes, for a
quantized linear ``P`` whose source weight is ``[N, K]`` (``[E, N, K]`` for stacked experts),
``K`` a multiple of 16:

=====================  ================  ==============  ==================================
name                   dtype             shape           meaning
=====================  ================  ==============  ==================================
``P.weight``           uint8             ``[N, K/2]``    two E2M1 codes a byte
``P.weight_scale``     float8_e4m3fn     ``[N, K/16]``   one scale per 1x16 block, row-major
``P.weight_scale_2``   float32           ``[]`` / [E]    the global decode scale
``P.input_scale``      float32           ``[]`` / [E]    activation scale (optional)
=====================  ================  ==============  ==================================

An E2M1 *code* is ``sign << 3 | index`` (0..15); its *value* is ``E2M1_VALUES[code]``, with
magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0.0). The two are kept apart by name:
:func:`pack_e2m1_codes` / :func:`unpack_e2m1_codes` move codes in and out of bytes (the even
element in the low nibble), :func:`e2m1_code_values` turns codes into values. A weight is
``E2M1_VALUES[code] * (float(weight_scale) * weight_scale_2)``, computed in fp32.

Departure from a plain decoder: :func:`dequantize_nvfp4` refuses NaN, Inf and negative
scales (E4M3 can encode NaN) instead of handing a poisoned weight to an engine.
The quantizer itself (the TE-bitwise math) lives in ``posttrain.quant_convert``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from posttrain.formats._errors import NVFP4FormatError
from posttrain.formats._finite import value_range
from posttrain.formats._safetensors import SAFETENSORS_DTYPES

__all__ = [
    "E2M1_VALUES",
    "GROUP_SIZE",
    "NVFP4Part",
    "NVFP4TensorSpec",
    "dequantize_nvfp4",
    "dequantize_nvfp4_state_dict",
    "e2m1_code_values",
    "nvfp4_layout",
    "pack_e2m1_codes",
    "unpack_e2m1_codes",
]

GROUP_SIZE = 16
"""Elements per block scale (one ``weight_scale`` per 1x16 block)."""

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
"""The value of each E2M1 code 0..15 (``sign << 3 | magnitude index``)."""

NVFP4Part = Literal["weight", "weight_scale", "weight_scale_2", "input_scale"]

_DTYPES: dict[NVFP4Part, torch.dtype] = {
    "weight": torch.uint8,
    "weight_scale": torch.float8_e4m3fn,
    "weight_scale_2": torch.float32,
    "input_scale": torch.float32,
}
# Scales a ModelOpt checkpoint may carry besides the weight's; all are dropped on dequantizing.
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


@dataclass(frozen=True, slots=True, kw_only=True)
class NVFP4TensorSpec:
    """One checkpoint tensor of a quantized linear: its name, role, dtype and shape."""

    name: str
    part: NVFP4Part
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def safetensors_dtype(self) -> str:
        """The dtype's name in a safetensors header (``U8``, ``F8_E4M3``, ``F32``)."""
        return SAFETENSORS_DTYPES[self.dtype]


def nvfp4_layout(
    weight_name: str, shape: Sequence[int], *, input_scale: bool = False
) -> tuple[NVFP4TensorSpec, ...]:
    """The tensors that replace the source weight ``weight_name`` of ``shape`` when quantized.

    In checkpoint order: ``weight``, ``weight_scale``, ``weight_scale_2`` and, when
    ``input_scale``, ``input_scale``. Raises :class:`NVFP4FormatError` for a name without
    ``.weight``, a rank other than 2 or 3, or K not a multiple of 16.
    """
    if not weight_name.endswith(".weight"):
        raise NVFP4FormatError(f"{weight_name}: an NVFP4 weight name ends in '.weight'")
    dims = tuple(int(d) for d in shape)
    if len(dims) not in (2, 3) or dims[-1] % GROUP_SIZE:
        raise NVFP4FormatError(
            f"{weight_name}: shape {list(dims)} is not [N, K] or [E, N, K] with K a multiple "
            f"of {GROUP_SIZE}"
        )
    module = weight_name.removesuffix(".weight")
    *lead, n, k = dims
    shapes: dict[NVFP4Part, tuple[int, ...]] = {
        "weight": (*lead, n, k // 2),
        "weight_scale": (*lead, n, k // GROUP_SIZE),
        "weight_scale_2": tuple(lead),
    }
    if input_scale:
        shapes["input_scale"] = tuple(lead)
    return tuple(
        NVFP4TensorSpec(
            name=f"{module}.{part}",
            part=part,
            dtype=_DTYPES[part],
            shape=s,
        )
        for part, s in shapes.items()
    )


def pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` (uint8, 0..15) to bytes ``[..., K/2]``: the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., K/2]`` to codes ``[..., K]`` (uint8, 0..15); the inverse of packing."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_code_values(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 value of each E2M1 code (``E2M1_VALUES[code]``), same shape as ``codes``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _finite_non_negative(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    low, high = value_range(t)  # NaN in both extremes when t holds one
    return math.isfinite(low) and math.isfinite(high) and low >= 0


def _check_group(
    name: str, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate one group; returns the block scales and ``scale_2`` in fp32, ``scale_2`` shaped
    to broadcast over blocks."""
    if packed.dtype != torch.uint8:
        raise NVFP4FormatError(f"{name}.weight: NVFP4 codes must be uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise NVFP4FormatError(f"{name}.weight_scale: must be float8_e4m3fn, got {scale.dtype}")
    k = packed.shape[-1] * 2 if packed.dim() else 0
    if packed.dim() not in (2, 3) or k % GROUP_SIZE:
        raise NVFP4FormatError(
            f"{name}.weight: shape {list(packed.shape)} is not [N, K/2] or [E, N, K/2] with K "
            f"a multiple of {GROUP_SIZE}"
        )
    if tuple(scale.shape) != (*packed.shape[:-1], k // GROUP_SIZE):
        raise NVFP4FormatError(
            f"{name}.weight_scale: shape {list(scale.shape)} does not match codes "
            f"{list(packed.shape)} (expected [..., K/16] with K={k})"
        )
    s2 = scale_2.to(torch.float32)
    if packed.dim() == 3 and s2.numel() == packed.shape[0] and s2.dim() <= 1:
        s2 = s2.reshape(-1, 1, 1)
    elif s2.numel() == 1:
        s2 = s2.reshape(())
    else:
        raise NVFP4FormatError(
            f"{name}.weight_scale_2: shape {list(scale_2.shape)} is neither a scalar nor [E]"
        )
    if not _finite_non_negative(s2):
        raise NVFP4FormatError(f"{name}.weight_scale_2: not a finite non-negative scale")
    sf = scale.to(torch.float32)
    if not _finite_non_negative(sf):
        raise NVFP4FormatError(f"{name}.weight_scale: holds NaN or negative block scales")
    return sf, s2


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    name: str = "weight",
) -> torch.Tensor:
    """The weight ``[..., N, K]`` of one NVFP4 group, computed in fp32, then cast to ``dtype``.

    ``packed`` is uint8 ``[..., N, K/2]``, ``scale`` float8_e4m3fn ``[..., N, K/16]`` and
    ``scale_2`` a scalar (``[E]`` for a 3-D stack). Raises :class:`NVFP4FormatError` naming
    ``name`` for a wrong dtype or shape, or a NaN, infinite or negative scale.
    """
    sf, s2 = _check_group(name, packed, scale, scale_2)
    values = e2m1_code_values(unpack_e2m1_codes(packed))
    block = sf * s2
    out = values.reshape(*values.shape[:-1], -1, GROUP_SIZE) * block.unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)


def dequantize_nvfp4_state_dict(
    tensors: Mapping[str, torch.Tensor],
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    default_dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """Replace every NVFP4 group by its dequantized ``.weight``; drop every scale tensor.

    A group is recognised by its ``.weight_scale``. Each dequantized weight takes the dtype
    ``dtypes`` gives for its name (else ``default_dtype``); other tensors pass unchanged.
    Returns the new state dict and the names dequantized. A scale without its codes, codes
    without ``weight_scale_2``, or uint8 ``.weight`` codes without scales raise
    :class:`NVFP4FormatError` naming the tensor.
    """
    dtypes = dtypes or {}
    modules = {k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale")}
    out: dict[str, torch.Tensor] = {}
    done: list[str] = []
    for key, t in tensors.items():
        if key.endswith(_SCALE_SUFFIXES):
            module = key.rsplit(".", 1)[0]
            if key.endswith((".weight_scale", ".weight_scale_2")) and (
                module + ".weight" not in tensors
            ):
                raise NVFP4FormatError(f"{key}: scale without codes {module}.weight")
            continue
        if key.endswith(".weight") and key.removesuffix(".weight") in modules:
            module = key.removesuffix(".weight")
            s2 = tensors.get(module + ".weight_scale_2")
            if s2 is None:
                raise NVFP4FormatError(f"{module}.weight_scale_2: missing for NVFP4 codes {key}")
            scale = tensors[module + ".weight_scale"]
            out[key] = dequantize_nvfp4(
                t, scale, s2, dtype=dtypes.get(key, default_dtype), name=module
            )
            done.append(key)
            continue
        if t.dtype == torch.uint8 and key.endswith(".weight"):
            raise NVFP4FormatError(f"{key}: uint8 weight without {key}_scale (NVFP4 codes alone)")
        out[key] = t
    return out, tuple(done)
