"""Tiny model shapes the tests of several packages share, in transformers' config names.

Import it from tests only (``from posttrain.models.testing import hf_config``);
``import posttrain.models`` does not load it.

- ``HF_TINY``: a tiny dense shape (the keyword arguments of ``Qwen3Config``, ``LlamaConfig``,
  ``Qwen2Config``, ...): 2 layers of width 32, 4 query and 2 key/value heads of 8.
- ``HF_MLA``: ``ModelConfig.mla_tiny``'s attention (4 heads, query/kv latents of 16, nope 8 +
  rope 4 per head, values of 12) with a DeepSeek-style MoE (layer 0 dense, then 8 routed
  experts, top 2), for ``DeepseekV3Config`` and ``Glm4MoeLiteConfig``; use it over ``HF_TINY``.
- ``hf_config(cls_name, arch, **extra)``: that transformers config class built from
  ``HF_TINY | extra``, its ``architectures`` set to ``[arch]``.
"""

from __future__ import annotations

from typing import Any

import transformers

from posttrain.models._config import MLA_TINY_ATTENTION

__all__ = ["HF_MLA", "HF_TINY", "hf_config"]

HF_TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}

HF_MLA: dict[str, Any] = {
    **MLA_TINY_ATTENTION,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
}


def hf_config(cls_name: str, arch: str, **extra: Any) -> transformers.PretrainedConfig:
    """``transformers.<cls_name>(**(HF_TINY | extra))`` with ``architectures = [arch]``."""
    config: transformers.PretrainedConfig = getattr(transformers, cls_name)(**(HF_TINY | extra))
    config.architectures = [arch]
    return config
