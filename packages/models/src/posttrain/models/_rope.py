"""Rotary position embeddings: the rope types the decoder computes exactly, read from HF configs.

Supported ``rope_type`` values (transformers' formulas, computed here in fp64 and cast to fp32):

* ``default``: ``inv_freq[j] = theta ** (-2j / d)``.
* ``linear``: the default frequencies divided by ``factor``.
* ``llama3``: Llama 3.x's wavelength bands (``factor``, ``low_freq_factor``,
  ``high_freq_factor``, ``original_max_position_embeddings``).
* ``yarn``: YaRN's ramp between interpolated and extrapolated frequencies and its
  ``attention_factor`` on cos/sin (``beta_fast``, ``beta_slow``, ``mscale``,
  ``mscale_all_dim``, ``truncate``).

A config may give them the transformers-5 way (``rope_parameters`` holding ``rope_type`` and
``rope_theta``) or the legacy way (``rope_theta`` plus ``rope_scaling`` with ``rope_type`` or
``type``). Everything else is refused with a ``ModelConfigError`` naming the architecture and
the feature: ``dynamic`` (its frequencies depend on the running sequence length, so a token's
rope would differ between a training forward and a decode step), ``longrope``, per-layer-type
rope dicts that differ, ``partial_rotary_factor != 1``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.models._errors import ModelConfigError

SCALED_ROPE_TYPES = ("linear", "llama3", "yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(
    factor: float, mscale: float | None, mscale_all_dim: float | None, given: float | None
) -> float:
    """YaRN's factor on cos/sin: ``given`` if set, else the ratio of the two ``mscale``
    corrections when both are set and nonzero, else ``yarn_get_mscale(factor)``."""
    if given is not None:
        return given
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    return yarn_get_mscale(factor)


def yarn_inv_freq(
    extrapolation: Tensor,
    *,
    dim: int,
    theta: float,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> Tensor:
    """YaRN's frequencies from the default ones (``extrapolation``, fp64 ``[dim // 2]``):
    those below the correction range divided by ``factor``, those above kept, a linear ramp
    between (transformers' formula)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    return extrapolation / factor * (1.0 - keep) + extrapolation * keep


def _number(where: str, params: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelConfigError(f"{where}: rope {key}={value!r} is not a finite number")
    return float(value)


@dataclass(kw_only=True, slots=True, frozen=True)
class RopeScaling:
    """A scaled rope (``linear``, ``llama3`` or ``yarn``) with transformers' field names."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SCALED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type={self.rope_type!r} is not supported (supported: default, "
                f"{', '.join(SCALED_ROPE_TYPES)})"
            )
        if not self.factor > 0:
            raise ModelConfigError(f"rope {self.rope_type} factor={self.factor} must be > 0")
        if self.rope_type != "linear" and self.original_max_position_embeddings <= 0:
            raise ModelConfigError(
                f"rope {self.rope_type} needs original_max_position_embeddings > 0, got "
                f"{self.original_max_position_embeddings}"
            )
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ModelConfigError(
                f"rope llama3 high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields transformers reads for this rope type (``rope_type`` first)."""
        data = asdict(self)
        keep = {
            "linear": ("rope_type", "factor"),
            "llama3": (
                "rope_type",
                "factor",
                "original_max_position_embeddings",
                "low_freq_factor",
                "high_freq_factor",
            ),
            "yarn": (
                "rope_type",
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "attention_factor",
                "truncate",
            ),
        }[self.rope_type]
        return {k: data[k] for k in keep if data[k] is not None}

    @property
    def cos_sin_factor(self) -> float:
        """The factor transformers multiplies into cos and sin (YaRN's ``attention_factor``)."""
        if self.rope_type != "yarn":
            return 1.0
        return yarn_attention_factor(
            self.factor, self.mscale, self.mscale_all_dim, self.attention_factor
        )

    def inv_freq(self, dim: int, theta: float) -> Tensor:
        """Inverse frequencies ``[dim // 2]`` in fp64."""
        base = default_inv_freq(dim, theta)
        if self.rope_type == "linear":
            return base / self.factor
        if self.rope_type == "yarn":
            return yarn_inv_freq(
                base,
                dim=dim,
                theta=theta,
                factor=self.factor,
                original=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
            )
        # llama3: long wavelengths divided by factor, short ones kept, a smooth band between
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / self.factor, base)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)


def default_inv_freq(dim: int, theta: float) -> Tensor:
    """``theta ** (-2j / dim)`` for ``j < dim // 2``, fp64."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def rope_tables(
    head_dim: int, capacity: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[capacity, head_dim]`` (HF rotate-half layout), computed in fp64."""
    inv = (
        default_inv_freq(head_dim, theta) if scaling is None else scaling.inv_freq(head_dim, theta)
    )
    return tables_of(inv, capacity, 1.0 if scaling is None else scaling.cos_sin_factor)


def tables_of(inv_freq: Tensor, capacity: int, factor: float) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin ``[capacity, 2 * len(inv_freq)]`` (rotate-half layout) times ``factor``,
    from fp64 ``inv_freq``."""
    freqs = torch.arange(capacity, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * factor).float(), (emb.sin() * factor).float()


def read_rope(hf: Mapping[str, Any], architecture: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of an HF config dict (``rope_parameters`` or legacy
    ``rope_theta`` + ``rope_scaling``); what is not computed exactly raises a
    ``ModelConfigError`` naming ``architecture`` and the feature."""
    where = f"{architecture}"
    params: Any = hf.get("rope_parameters")
    if params is None:
        params = hf.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ModelConfigError(f"{where}: rope parameters {params!r} are not an object")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        # per-layer-type rope dicts (transformers 5): one rope for every layer only
        distinct = {repr(sorted(v.items())) for v in params.values()}
        if len(distinct) != 1:
            raise ModelConfigError(
                f"{where}: a different rope per layer type ({sorted(params)}) is not supported"
            )
        params = next(iter(params.values()))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = _number(where, params, "rope_theta", _number(where, hf, "rope_theta", 10000.0))
    assert theta is not None
    if not theta > 0:
        raise ModelConfigError(f"{where}: rope_theta={theta} must be > 0")
    partial = _number(
        where, params, "partial_rotary_factor", _number(where, hf, "partial_rotary_factor", None)
    )
    if partial is not None and partial != 1.0:
        raise ModelConfigError(
            f"{where}: partial_rotary_factor={partial} is not supported (rope on every dim only)"
        )
    if rope_type == "default":
        return theta, None
    if rope_type not in SCALED_ROPE_TYPES:
        raise ModelConfigError(
            f"{where}: rope_type={rope_type!r} is not supported (supported: default, "
            f"{', '.join(SCALED_ROPE_TYPES)})"
        )
    original = params.get(
        "original_max_position_embeddings",
        hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")),
    )
    factor = _number(where, params, "factor", None)
    if factor is None:
        if rope_type == "yarn" and isinstance(original, int) and original > 0:
            factor = float(hf.get("max_position_embeddings", 0)) / original
        else:
            raise ModelConfigError(f"{where}: rope_type={rope_type!r} needs a 'factor'")
    if original is not None and (not isinstance(original, int) or isinstance(original, bool)):
        raise ModelConfigError(
            f"{where}: original_max_position_embeddings={original!r} must be an int"
        )
    try:
        return theta, RopeScaling(
            rope_type=str(rope_type),
            factor=factor,
            original_max_position_embeddings=int(original or 0),
            low_freq_factor=_number(where, params, "low_freq_factor", 1.0) or 1.0,
            high_freq_factor=_number(where, params, "high_freq_factor", 4.0) or 4.0,
            beta_fast=_number(where, params, "beta_fast", None) or 32.0,
            beta_slow=_number(where, params, "beta_slow", None) or 1.0,
            mscale=_number(where, params, "mscale", None),
            mscale_all_dim=_number(where, params, "mscale_all_dim", None),
            attention_factor=_number(where, params, "attention_factor", None),
            truncate=bool(params.get("truncate", True)),
        )
    except ModelConfigError as exc:
        raise ModelConfigError(f"{where}: {exc}") from exc
