"""The typed model config and its mapping to a Qwen3-MoE HF ``config.json``.

Field names are the HF ``Qwen3MoeConfig`` names, so ``to_hf_dict`` / ``from_hf_dict``
are nearly the identity. Departures from the HF class:

* Dense layers are chosen exactly as HF does: layer ``i`` is MoE when
  ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``.
* ``max_position_embeddings`` is also the capacity ``C`` of the fixed-size key buffer
  that strict attention reduces over (see ``_ops``), so keep it small for tiny models.
* Features the strict kernels do not implement are refused, not ignored:
  ``attention_bias``, sliding windows, rope scaling, activations other than SiLU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.models._errors import ModelConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """Shape and numerics of a Dense/MoE decoder (Qwen3-MoE HF field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 64
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "decoder_sparse_step",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE)")
        if self.num_experts < 0:
            raise ModelConfigError(f"ModelConfig.num_experts={self.num_experts} must be >= 0")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelConfigError(
                f"ModelConfig.moe_intermediate_size={self.moe_intermediate_size} must be positive"
            )
        for i in self.mlp_only_layers:
            if not 0 <= i < self.num_hidden_layers:
                raise ModelConfigError(
                    f"ModelConfig.mlp_only_layers holds {i}, outside [0, {self.num_hidden_layers})"
                )
        if self.torch_dtype not in _DTYPES:
            raise ModelConfigError(
                f"ModelConfig.torch_dtype={self.torch_dtype!r} is not one of {sorted(_DTYPES)}"
            )
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(f"ModelConfig.rms_norm_eps={self.rms_norm_eps} must be > 0")

    @property
    def dtype(self) -> torch.dtype:
        """The parameter dtype (``torch_dtype``); activations are fp32 in strict mode."""
        return _DTYPES[self.torch_dtype]

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` is MoE (HF rule: ``mlp_only_layers`` and ``decoder_sparse_step``)."""
        return (
            index not in self.mlp_only_layers
            and self.num_experts > 0
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"dense"`` or ``"moe"`` for each layer."""
        return tuple(
            "moe" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)
        )

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **changes: Any) -> ModelConfig:
        """The tiny test config: 4 layers (first dense), hidden 32, 4 experts, top-2, vocab 128."""
        base: dict[str, Any] = {
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": (0,),
            "max_position_embeddings": 64,
            "rope_theta": 10000.0,
            "initializer_range": 0.1,
            "bos_token_id": 1,
            "eos_token_id": 3,
            "pad_token_id": 0,
        }
        base.update(changes)
        return cls(**base)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict that ``transformers`` reads as a ``Qwen3MoeConfig``."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "torch_dtype": self.torch_dtype,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Read a Qwen3-MoE ``config.json`` dict; unsupported features raise ModelConfigError."""
        data = dict(data)
        for key, ok in (
            ("hidden_act", "silu"),
            ("attention_bias", False),
            ("use_sliding_window", False),
        ):
            if key in data and data[key] not in (ok, None):
                raise ModelConfigError(f"config.json {key}={data[key]!r} is not supported")
        if data.get("rope_scaling"):
            raise ModelConfigError(f"config.json rope_scaling={data['rope_scaling']!r} unsupported")
        if "rope_theta" not in data and isinstance(data.get("rope_parameters"), dict):
            data["rope_theta"] = data["rope_parameters"].get("rope_theta", 10000.0)
        if "num_experts" not in data and "num_local_experts" in data:
            data["num_experts"] = data["num_local_experts"]
        if "head_dim" not in data or data["head_dim"] is None:
            data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
        if "dtype" in data and "torch_dtype" not in data:
            data["torch_dtype"] = data["dtype"]
        names = {f.name for f in dataclasses.fields(cls)}
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        for key in required:
            if key not in data:
                raise ModelConfigError(f"config.json lacks the required field {key!r}")
        kwargs: dict[str, Any] = {k: data[k] for k in names if k in data}
        kwargs.setdefault("num_key_value_heads", data["num_attention_heads"])
        kwargs.setdefault("moe_intermediate_size", 0)
        kwargs.setdefault("num_experts", 0)
        kwargs.setdefault("num_experts_per_tok", 1)
        kwargs["mlp_only_layers"] = tuple(int(i) for i in kwargs.get("mlp_only_layers") or ())
        kwargs["rope_theta"] = float(kwargs.get("rope_theta", 10000.0))
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)
