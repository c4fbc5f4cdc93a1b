"""Shape and rope of multi-head latent attention (MLA), read from a DeepSeek-V3 / GLM-4.x-Lite config.

``MlaSpec`` holds what ``DeepseekV3Attention`` and ``Glm4MoeLiteAttention`` (transformers 5)
read from their configs: ``q_lora_rank`` (``None``: a plain ``q_proj``), ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim`` and the rope (``MlaRope``). Facts
taken from transformers 5.24's modules, each one a place where the obvious reading is wrong:

* **The latent norms ignore ``rms_norm_eps``.** ``q_a_layernorm`` and ``kv_a_layernorm`` are
  built with the RMSNorm default ``eps = 1e-6`` whatever the config says (GLM-4.7-Flash has
  ``rms_norm_eps = 1e-5``). ``latent_norm_eps`` is that 1e-6. SGLang (0.5.x,
  ``deepseek_v2.py``) builds them with ``config.rms_norm_eps`` instead: for GLM-4.7-Flash the
  two disagree, and the trainer follows transformers (the parity contract).
* **Rope runs on the ``qk_rope_head_dim`` part only**, with one key shared by all heads. With
  ``rope_interleave`` (the default of both classes) the checkpoint's rope dims are in
  interleaved pairs ``(x0, x1), (x2, x3), ...``; transformers rotates pair ``i`` by frequency
  ``i`` and writes the result *de-interleaved*, evens first: ``[x_even * cos - x_odd * sin,
  x_odd * cos + x_even * sin]``. That equals taking ``cat(x[0::2], x[1::2])`` and applying
  the usual rotate-half rope, which is what ``deinterleave`` + ``_ops.apply_rope`` do (bit for
  bit: ``a - b`` and ``a + (-b)`` round the same). Queries and keys get the same permutation,
  so the scores are those of the interleaved rotation. Without ``rope_interleave`` the rope
  dims are already in rotate-half layout.
* **The rope tables are ``qk_rope_head_dim`` wide** (``head_dim`` is an alias of it in both
  config classes), with YaRN's ``attention_factor`` multiplied into cos and sin.
* **The softmax scale** is ``qk_head_dim ** -0.5`` times ``yarn_get_mscale(factor,
  mscale_all_dim) ** 2`` whenever the rope type is not ``default`` and ``mscale_all_dim`` is
  set (DeepSeek-V3: ``mscale = mscale_all_dim = 1``, so the cos/sin factor is 1 and all of
  the mscale goes into the softmax scale).
* ``num_key_value_heads`` must equal ``num_attention_heads``: MLA expands the latent into
  per-head keys, and transformers' ``repeat_kv`` would fail on anything else.

Refused by name (``ModelConfigError``), not approximated: ``attention_bias``, rope types
other than ``default`` and ``yarn``, ``partial_rotary_factor != 1``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from posttrain.models._errors import ModelConfigError
from posttrain.models._rope import RopeScaling, default_inv_freq, tables_of, yarn_get_mscale

DEFAULT_LATENT_NORM_EPS = 1e-6
"""The eps transformers gives ``q_a_layernorm`` / ``kv_a_layernorm`` (its RMSNorm default)."""

_ROPE_TYPES = ("default", "yarn")


def _number(hf: Mapping[str, Any], key: str, default: float | None = None) -> float | None:
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelConfigError(f"config.json: rope {key}={value!r} is not a finite number")
    return float(value)


@dataclass(kw_only=True, slots=True, frozen=True)
class MlaRope:
    """The decoupled rope of MLA: its theta, its layout and, for YaRN, a ``RopeScaling``.

    The YaRN fields (transformers' names and defaults: ``beta_fast`` 32, ``beta_slow`` 1,
    ``truncate`` True; ``attention_factor`` None means "derived from ``mscale`` and
    ``mscale_all_dim``") live in ``_rope.RopeScaling``, the one place the decoder's rope math
    reads them; ``scaling`` None is the default rope. Other scaled rope types are refused.
    """

    rope_theta: float = 10000.0
    interleave: bool = True
    scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if not self.rope_theta > 0:
            raise ModelConfigError(f"MLA rope_theta={self.rope_theta} must be > 0")
        if self.scaling is not None and self.scaling.rope_type != "yarn":
            raise ModelConfigError(
                f"MLA rope_type={self.scaling.rope_type!r} is not supported (supported: "
                f"{list(_ROPE_TYPES)})"
            )

    @property
    def rope_type(self) -> str:
        """``"default"`` or ``"yarn"``."""
        return "default" if self.scaling is None else self.scaling.rope_type

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> MlaRope:
        """Read ``rope_parameters`` (transformers 5) or the legacy ``rope_scaling`` + ``rope_theta``."""
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise ModelConfigError(f"config.json: rope parameters {params!r} are not an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = _number(params, "rope_theta", _number(hf, "rope_theta", 10000.0))
        partial = _number(params, "partial_rotary_factor", _number(hf, "partial_rotary_factor"))
        if partial is not None and partial != 1.0:
            raise ModelConfigError(
                f"config.json: MLA with partial_rotary_factor={partial} is not supported "
                "(the rope part is qk_rope_head_dim wide)"
            )
        interleave = hf.get("rope_interleave", True)
        if not isinstance(interleave, bool):
            raise ModelConfigError(f"config.json: rope_interleave={interleave!r} is not a bool")
        assert theta is not None
        if rope_type not in _ROPE_TYPES:
            raise ModelConfigError(
                f"MLA rope_type={rope_type!r} is not supported (supported: {list(_ROPE_TYPES)})"
            )
        if rope_type == "default":
            return cls(rope_theta=theta, interleave=interleave)
        original = params.get(
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings", hf.get("max_position_embeddings")),
        )
        factor = _number(params, "factor")
        if factor is None:
            raise ModelConfigError("config.json: yarn rope parameters need a 'factor'")
        scaling = RopeScaling(
            rope_type="yarn",
            factor=factor,
            original_max_position_embeddings=int(original) if original is not None else 0,
            beta_fast=_number(params, "beta_fast") or 32.0,
            beta_slow=_number(params, "beta_slow") or 1.0,
            mscale=_number(params, "mscale"),
            mscale_all_dim=_number(params, "mscale_all_dim"),
            attention_factor=_number(params, "attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )
        return cls(rope_theta=theta, interleave=interleave, scaling=scaling)

    @classmethod
    def of(cls, rope_theta: float, interleave: bool, scaling: RopeScaling | None) -> MlaRope:
        """The MLA rope of a decoder config's ``rope_theta`` / ``rope_scaling`` (None or YaRN)."""
        return cls(rope_theta=rope_theta, interleave=interleave, scaling=scaling)

    @property
    def cos_sin_factor(self) -> float:
        """The factor transformers multiplies into cos and sin (YaRN's ``attention_factor``)."""
        return 1.0 if self.scaling is None else self.scaling.cos_sin_factor

    @property
    def softmax_mscale(self) -> float:
        """The factor on the softmax scale: ``yarn_get_mscale(factor, mscale_all_dim) ** 2``."""
        if self.scaling is None or not self.scaling.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.scaling.factor, self.scaling.mscale_all_dim) ** 2

    def inv_freq(self, dim: int) -> Tensor:
        """Inverse frequencies ``[dim // 2]`` in fp64 (transformers computes them in fp32)."""
        if self.scaling is None:
            return default_inv_freq(dim, self.rope_theta)
        return self.scaling.inv_freq(dim, self.rope_theta)

    def tables(self, dim: int, capacity: int) -> tuple[Tensor, Tensor]:
        """cos/sin ``[capacity, dim]`` fp32 in rotate-half layout, computed in fp64."""
        return tables_of(self.inv_freq(dim), capacity, self.cos_sin_factor)


def config_int(hf: Mapping[str, Any], key: str) -> int:
    """``hf[key]`` as a positive int, or a ``ModelConfigError`` naming the key."""
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"config.json: {key}={value!r} must be a positive int")
    return value


@dataclass(kw_only=True, slots=True, frozen=True)
class MlaSpec:
    """Shape, rope and norms of one MLA layer (transformers' field names)."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: MlaRope = MlaRope()
    latent_norm_eps: float = DEFAULT_LATENT_NORM_EPS

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"MlaSpec.{name} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and (
            not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0
        ):
            raise ModelConfigError(
                f"MlaSpec.q_lora_rank must be None or a positive int, got {self.q_lora_rank!r}"
            )
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"MlaSpec.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rope pairs)"
            )
        if not self.latent_norm_eps > 0:
            raise ModelConfigError(f"MlaSpec.latent_norm_eps={self.latent_norm_eps} must be > 0")

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> MlaSpec:
        """Read a ``DeepseekV3Config`` / ``Glm4MoeLiteConfig`` ``config.json`` (see the module doc)."""
        if hf.get("attention_bias", False):
            raise ModelConfigError(
                "config.json: MLA with attention_bias=true is not supported (no biases on "
                "q_a_proj / kv_a_proj_with_mqa / o_proj)"
            )
        heads = config_int(hf, "num_attention_heads")
        kv_heads = hf.get("num_key_value_heads", heads)
        if kv_heads is not None and kv_heads != heads:
            raise ModelConfigError(
                f"config.json: MLA needs num_key_value_heads == num_attention_heads, got "
                f"{kv_heads} and {heads}"
            )
        q_rank = hf.get("q_lora_rank")
        return cls(
            hidden_size=config_int(hf, "hidden_size"),
            num_heads=heads,
            q_lora_rank=None if q_rank is None else config_int(hf, "q_lora_rank"),
            kv_lora_rank=config_int(hf, "kv_lora_rank"),
            qk_nope_head_dim=config_int(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=config_int(hf, "qk_rope_head_dim"),
            v_head_dim=config_int(hf, "v_head_dim"),
            rope=MlaRope.from_hf_dict(hf),
        )

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Cached floats per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5`` times the YaRN ``mscale_all_dim`` correction."""
        return float(self.qk_head_dim**-0.5 * self.rope.softmax_mscale)

    def rope_tables(self, capacity: int) -> tuple[Tensor, Tensor]:
        """cos/sin ``[capacity, qk_rope_head_dim]`` (index them by position)."""
        return self.rope.tables(self.qk_rope_head_dim, capacity)
