"""The typed model config and its mapping to an HF ``config.json`` (Qwen3-MoE or Mellum).

Field names are the HF ``Qwen3MoeConfig`` names, so ``to_hf_dict`` / ``from_hf_dict``
are nearly the identity. Departures from the HF class:

* Dense layers are chosen exactly as HF Qwen3-MoE does: layer ``i`` is MoE when
  ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``.
* The checkpoint type depends on that layer pattern, so that SGLang builds it as written.
  SGLang 0.5.23's ``Qwen3MoeForCausalLM`` ignores ``mlp_only_layers`` and
  ``decoder_sparse_step`` (it builds every layer as MoE), so a config with a dense layer is
  written as ``mellum`` / ``MellumForCausalLM``: the Qwen3-MoE layer (q/k norm, GQA, SwiGLU
  dense MLP, softmax top-k router, no shared expert, the same tensor names) with a per-layer
  ``mlp_layer_types`` (``"dense"``/``"sparse"``) that both SGLang and transformers 5 honour;
  every layer ``full_attention`` with one default RoPE. A config without a dense layer (or
  without experts) stays ``qwen3_moe``. ``from_hf_dict`` reads both, and the older Qwen3-MoE
  checkpoints with ``mlp_only_layers``.
* The KV capacity ``C`` (``capacity``: ``kv_capacity``, else ``max_position_embeddings``)
  is a runtime setting: the length of KV-cache rows and rope tables. A training forward
  only reduces over the slots its positions reach, so a large ``C`` costs memory in the
  engine's cache, not time in the trainer.
* Other families (Qwen3, Qwen2/2.5, Llama 3.x, Mistral) are read and written by
  ``_families`` (``family``, ``qk_norm``, ``qkv_bias``, ``rope_scaling``); what the strict
  kernels do not implement is refused there, by architecture and feature, not ignored.

Optional Inkling-style blocks (all off by default; a config with none of them writes the
same ``config.json`` as before, so existing checkpoints are unchanged):

* ``sconv_kernel_size`` (0 = off): residual depthwise causal convolutions at four sites per
  layer (K and V before the k-norm, attention output after ``o_proj``, MLP/MoE output).
* ``rel_pos_dim`` / ``rel_pos_extent``: relative position bias from an extra projected stream
  ``r`` (heads x ``rel_pos_dim``) and a frozen table ``rel_proj[rel_pos_dim, extent]``.
* ``sliding_window_layers`` / ``sliding_window_size`` and ``swa_num_attention_heads``,
  ``swa_num_key_value_heads``, ``swa_head_dim``: sliding-window layers with their own shape.
* ``attention_softmax_scale`` (``"rsqrt_head_dim"`` or ``"inv_head_dim"``), ``qk_norm_per_head``.
* ``router_score_function`` (``"softmax"`` or ``"sigmoid"`` with a fixed expert bias),
  ``n_shared_experts``, ``shared_expert_intermediate_size``, ``routed_scaling_factor``.
* ``embedding_rms_norm``, ``logits_divisor`` (muP width multiplier).

Such a config is written with ``architectures = ["InklingForCausalLM"]`` and
``model_type = "posttrain_inkling"`` (``transformers`` has no class for it; ``posttrain``
and ``local-engine`` load it).

Optional multimodal towers (off by default; see ``_towers`` and ``_media``):

* ``image_token_id`` + ``vision_patch_size`` / ``vision_hidden_size`` /
  ``vision_intermediate_size``: a frozen vision tower (one embedding per ``p x p`` RGB patch).
* ``audio_token_id`` + ``audio_num_mel_bins`` / ``audio_hidden_size`` /
  ``audio_intermediate_size``: a frozen audio tower (one embedding per mel frame).

A config with a tower is written with ``architectures = ["PosttrainMultimodalForCausalLM"]``
and ``model_type = "posttrain_multimodal"`` (plus every Inkling-style field).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from posttrain.models._errors import ModelConfigError
from posttrain.models._rope import RopeScaling, read_rope

if TYPE_CHECKING:
    from posttrain.models._ds_moe import DeepseekMoeSpec
    from posttrain.models._mla_config import MlaSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SOFTMAX_SCALES = ("rsqrt_head_dim", "inv_head_dim")
_ROUTER_SCORES = ("softmax", "sigmoid")
# Inkling-style fields and their "off" defaults: a config at these values is plain Qwen3-MoE.
_EXTENSION_DEFAULTS: dict[str, Any] = {
    "sconv_kernel_size": 0,
    "rel_pos_dim": 0,
    "rel_pos_extent": 0,
    "sliding_window_layers": (),
    "sliding_window_size": 0,
    "swa_num_attention_heads": None,
    "swa_num_key_value_heads": None,
    "swa_head_dim": None,
    "attention_softmax_scale": "rsqrt_head_dim",
    "qk_norm_per_head": False,
    "router_score_function": "softmax",
    "n_shared_experts": 0,
    "shared_expert_intermediate_size": 0,
    "routed_scaling_factor": 1.0,
    "embedding_rms_norm": False,
    "logits_divisor": 1.0,
}


# The MLA / DeepSeek-routing fields (read and written by the MLA families only).
_MLA_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "n_group",
    "topk_group",
)


# Multimodal tower fields and their "off" defaults (a config at these values has no tower).
# ``ModelConfig.mla_tiny``'s attention, in names ours and transformers' share (its MLA configs':
# ``DeepseekV3Config``, ``Glm4MoeLiteConfig``); ``posttrain.models.testing`` builds on it.
MLA_TINY_ATTENTION: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
}

_MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "image_token_id": None,
    "vision_patch_size": 0,
    "vision_hidden_size": 0,
    "vision_intermediate_size": 0,
    "audio_token_id": None,
    "audio_num_mel_bins": 0,
    "audio_hidden_size": 0,
    "audio_intermediate_size": 0,
}


class AttentionShape(NamedTuple):
    """Attention shape of one layer: query heads, key/value heads, head dim."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    # ---- the HF family (``_families``) and its switches
    family: str = "qwen3_moe"
    qk_norm: bool = True
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    kv_capacity: int | None = None
    """Key/value slots per sequence (``capacity``); None = ``max_position_embeddings``. A
    runtime setting (engine and trainer), not written to ``config.json``."""
    # ---- optional Inkling-style blocks (see the module docstring); defaults = off
    sconv_kernel_size: int = 0
    rel_pos_dim: int = 0
    rel_pos_extent: int = 0
    sliding_window_layers: tuple[int, ...] = ()
    sliding_window_size: int = 0
    swa_num_attention_heads: int | None = None
    swa_num_key_value_heads: int | None = None
    swa_head_dim: int | None = None
    attention_softmax_scale: str = "rsqrt_head_dim"
    qk_norm_per_head: bool = False
    router_score_function: str = "softmax"
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    embedding_rms_norm: bool = False
    logits_divisor: float = 1.0
    # ---- optional multimodal towers (see the module docstring); defaults = off
    image_token_id: int | None = None
    vision_patch_size: int = 0
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    audio_token_id: int | None = None
    audio_num_mel_bins: int = 0
    audio_hidden_size: int = 0
    audio_intermediate_size: int = 0
    # ---- multi-head latent attention (DeepSeek-V3 / GLM-4.x-Lite families; ``_mla``):
    # ``kv_lora_rank`` 0 = off. With MLA, ``head_dim`` is ``qk_rope_head_dim`` (the HF alias)
    # and the rope is ``rope_theta`` / ``rope_scaling`` on the rope part only.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # ---- DeepSeek-style group-limited routing (the MLA families; ``_ds_moe``)
    n_group: int = 1
    topk_group: int = 1

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
        if self.kv_capacity is not None and (
            not _is_int(self.kv_capacity) or self.kv_capacity <= 0
        ):
            raise ModelConfigError(
                f"ModelConfig.kv_capacity must be a positive int or None, got {self.kv_capacity!r}"
            )
        for name in ("qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(
                    f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ModelConfigError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
        self._validate_extensions()
        self._validate_towers()
        if self.kv_lora_rank:
            self.mla_spec  # noqa: B018  (validates the MLA fields, naming the bad one)
            if self.num_experts:
                self.deepseek_moe_spec  # noqa: B018
        from posttrain.models._families import family_named

        family_named(self.family).check(self)

    @property
    def capacity(self) -> int:
        """Key/value slots per sequence: ``kv_capacity``, else ``max_position_embeddings``.

        Positions run in ``[0, capacity)``; rope tables and KV-cache rows have this length.
        A training forward's cost does not grow with it (see ``PackedLayout``)."""
        return self.kv_capacity if self.kv_capacity is not None else self.max_position_embeddings

    def extension_fields_on(self) -> list[str]:
        """The optional-block fields not at their "off" default."""
        return [k for k, v in _EXTENSION_DEFAULTS.items() if getattr(self, k) != v]

    def _validate_towers(self) -> None:
        """Each multimodal tower field, with a ModelConfigError naming it."""
        for name in _MULTIMODAL_DEFAULTS:
            value = getattr(self, name)
            if name.endswith("_token_id"):
                if value is not None and (not _is_int(value) or not 0 <= value < self.vocab_size):
                    raise ModelConfigError(
                        f"ModelConfig.{name}={value!r} must be None or a token id in "
                        f"[0, vocab_size={self.vocab_size})"
                    )
            elif not _is_int(value) or value < 0:
                raise ModelConfigError(f"ModelConfig.{name} must be an int >= 0, got {value!r}")
        for tower, token, switch, sizes in (
            ("vision", "image_token_id", "vision_patch_size", ("vision_hidden_size",
             "vision_intermediate_size")),
            ("audio", "audio_token_id", "audio_num_mel_bins", ("audio_hidden_size",
             "audio_intermediate_size")),
        ):  # fmt: skip
            on = getattr(self, switch) > 0
            if on != (getattr(self, token) is not None):
                raise ModelConfigError(
                    f"ModelConfig.{token} and {switch} go together: the {tower} tower needs "
                    f"both (got {token}={getattr(self, token)!r}, {switch}={getattr(self, switch)})"
                )
            for size in sizes:
                if on != (getattr(self, size) > 0):
                    raise ModelConfigError(
                        f"ModelConfig.{size}={getattr(self, size)} must be positive exactly when "
                        f"the {tower} tower is on ({switch}={getattr(self, switch)})"
                    )
        if self.image_token_id is not None and self.image_token_id == self.audio_token_id:
            raise ModelConfigError(
                f"ModelConfig.image_token_id and audio_token_id are both {self.image_token_id}"
            )
        for token in ("image_token_id", "audio_token_id"):
            value = getattr(self, token)
            if value is None:
                continue
            for other in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if value == getattr(self, other):
                    raise ModelConfigError(
                        f"ModelConfig.{token}={value} is also the {other}: a media sentinel "
                        "needs a token of its own"
                    )

    @property
    def has_vision_tower(self) -> bool:
        """Whether the model has a vision tower (``vision_patch_size > 0``)."""
        return self.vision_patch_size > 0

    @property
    def has_audio_tower(self) -> bool:
        """Whether the model has an audio tower (``audio_num_mel_bins > 0``)."""
        return self.audio_num_mel_bins > 0

    @property
    def has_towers(self) -> bool:
        """Whether the model has any media tower (the config is a multimodal one)."""
        return self.has_vision_tower or self.has_audio_tower

    def _validate_extensions(self) -> None:
        """Each optional-block field, with a ModelConfigError naming it."""
        for name in ("sconv_kernel_size", "rel_pos_dim", "rel_pos_extent", "sliding_window_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ModelConfigError(f"ModelConfig.{name} must be an int >= 0, got {value!r}")
        if self.sconv_kernel_size == 1:
            raise ModelConfigError(
                "ModelConfig.sconv_kernel_size=1 is a per-channel scale, not a convolution: "
                "use 0 (off) or >= 2"
            )
        if self.rel_pos_dim and not self.rel_pos_extent:
            raise ModelConfigError(
                f"ModelConfig.rel_pos_extent must be positive when rel_pos_dim={self.rel_pos_dim}"
            )
        if self.rel_pos_extent and not self.rel_pos_dim:
            raise ModelConfigError(
                f"ModelConfig.rel_pos_extent={self.rel_pos_extent} needs rel_pos_dim > 0"
            )
        if self.rel_pos_extent > self.max_position_embeddings:
            raise ModelConfigError(
                f"ModelConfig.rel_pos_extent={self.rel_pos_extent} exceeds "
                f"max_position_embeddings={self.max_position_embeddings}"
            )
        seen: set[int] = set()
        for i in self.sliding_window_layers:
            if not _is_int(i) or not 0 <= i < self.num_hidden_layers or i in seen:
                raise ModelConfigError(
                    f"ModelConfig.sliding_window_layers holds {i!r}: not a distinct layer index "
                    f"in [0, {self.num_hidden_layers})"
                )
            seen.add(i)
        if self.sliding_window_layers and not self.sliding_window_size:
            raise ModelConfigError(
                "ModelConfig.sliding_window_size must be positive when sliding_window_layers "
                f"is {list(self.sliding_window_layers)}"
            )
        if self.sliding_window_size and not self.sliding_window_layers:
            raise ModelConfigError(
                f"ModelConfig.sliding_window_size={self.sliding_window_size} is set but "
                "sliding_window_layers is empty"
            )
        for name in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value) or value <= 0:
                raise ModelConfigError(
                    f"ModelConfig.{name} must be a positive int or None, got {value!r}"
                )
            if not self.sliding_window_layers:
                raise ModelConfigError(
                    f"ModelConfig.{name}={value} is set but sliding_window_layers is empty"
                )
        swa = self.swa_shape
        if swa.num_heads % swa.num_kv_heads:
            raise ModelConfigError(
                f"ModelConfig.swa_num_attention_heads={swa.num_heads} is not a multiple of "
                f"swa_num_key_value_heads={swa.num_kv_heads}"
            )
        if swa.head_dim % 2:
            raise ModelConfigError(f"ModelConfig.swa_head_dim={swa.head_dim} must be even (RoPE)")
        if self.attention_softmax_scale not in _SOFTMAX_SCALES:
            raise ModelConfigError(
                f"ModelConfig.attention_softmax_scale={self.attention_softmax_scale!r} is not "
                f"one of {list(_SOFTMAX_SCALES)}"
            )
        for name in ("qk_norm_per_head", "embedding_rms_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(
                    f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.router_score_function not in _ROUTER_SCORES:
            raise ModelConfigError(
                f"ModelConfig.router_score_function={self.router_score_function!r} is not one "
                f"of {list(_ROUTER_SCORES)}"
            )
        for name in ("n_shared_experts", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ModelConfigError(f"ModelConfig.{name} must be an int >= 0, got {value!r}")
        if self.n_shared_experts and self.router_score_function != "sigmoid":
            raise ModelConfigError(
                f"ModelConfig.n_shared_experts={self.n_shared_experts} needs "
                "router_score_function='sigmoid' (shared gates are normalised with the "
                "routed sigmoid weights)"
            )
        if self.n_shared_experts and not self.num_experts:
            raise ModelConfigError(
                f"ModelConfig.n_shared_experts={self.n_shared_experts} needs num_experts > 0"
            )
        if self.shared_expert_intermediate_size and not self.n_shared_experts:
            raise ModelConfigError(
                "ModelConfig.shared_expert_intermediate_size="
                f"{self.shared_expert_intermediate_size} is set but n_shared_experts is 0"
            )
        for name in ("routed_scaling_factor", "logits_divisor"):
            value = getattr(self, name)
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ModelConfigError(
                    f"ModelConfig.{name} must be a finite number > 0, got {value!r}"
                )

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def mla_spec(self) -> MlaSpec:
        """The MLA shape and rope of every layer (``_mla_config``); only with ``is_mla``."""
        from posttrain.models._mla_config import MlaRope, MlaSpec

        if not self.is_mla:
            raise ModelConfigError("ModelConfig.mla_spec: kv_lora_rank is 0 (no MLA)")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ModelConfigError(
                "ModelConfig: MLA needs num_key_value_heads == num_attention_heads, got "
                f"{self.num_key_value_heads} and {self.num_attention_heads}"
            )
        if self.head_dim != self.qk_rope_head_dim:
            raise ModelConfigError(
                f"ModelConfig: with MLA head_dim={self.head_dim} must equal "
                f"qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        try:
            rope = MlaRope.of(self.rope_theta, self.rope_interleave, self.rope_scaling)
        except ModelConfigError as exc:
            raise ModelConfigError(f"ModelConfig: {exc}") from exc
        return MlaSpec(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope=rope,
        )

    @property
    def deepseek_moe_spec(self) -> DeepseekMoeSpec:
        """The DeepSeek-style MoE block of the MLA families' MoE layers (``_ds_moe``)."""
        from posttrain.models._ds_moe import DeepseekMoeSpec

        return DeepseekMoeSpec(
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=self.n_shared_experts,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    @property
    def first_k_dense_replace(self) -> int:
        """Leading dense layers (DeepSeek's ``first_k_dense_replace``): ``mlp_only_layers``
        must be exactly ``0 .. k-1`` for the MLA families (checked by their family)."""
        k = 0
        while k < self.num_hidden_layers and not self.is_moe_layer(k):
            k += 1
        return k

    @property
    def uses_extensions(self) -> bool:
        """Whether any optional Inkling-style block is on (the config is not plain Qwen3-MoE)."""
        return bool(self.extension_fields_on())

    @property
    def swa_shape(self) -> AttentionShape:
        """Attention shape of sliding-window layers (the global shape where not overridden)."""
        return AttentionShape(
            self.swa_num_attention_heads or self.num_attention_heads,
            self.swa_num_key_value_heads or self.num_key_value_heads,
            self.swa_head_dim or self.head_dim,
        )

    def is_sliding_layer(self, index: int) -> bool:
        """Whether layer ``index`` attends over a sliding window (``sliding_window_layers``)."""
        return index in self.sliding_window_layers

    def attention_shape(self, index: int) -> AttentionShape:
        """Query heads, key/value heads and head dim of layer ``index``."""
        if self.is_sliding_layer(index):
            return self.swa_shape
        return AttentionShape(self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    def attention_window(self, index: int) -> int | None:
        """Keys a query of layer ``index`` may see (itself included); None = all before it."""
        return self.sliding_window_size if self.is_sliding_layer(index) else None

    def rel_extent(self, index: int) -> int:
        """Relative-bias extent of layer ``index``: the window on sliding layers, else
        ``rel_pos_extent`` (0 when the bias is off)."""
        if not self.rel_pos_dim:
            return 0
        return self.sliding_window_size if self.is_sliding_layer(index) else self.rel_pos_extent

    def softmax_scale(self, index: int) -> float:
        """Attention score scale of layer ``index``: 1/sqrt(head_dim) or 1/head_dim."""
        hd = self.attention_shape(index).head_dim
        return 1.0 / hd if self.attention_softmax_scale == "inv_head_dim" else hd**-0.5

    @property
    def shared_intermediate_size(self) -> int:
        """Intermediate size of each shared expert (``moe_intermediate_size`` unless set)."""
        return self.shared_expert_intermediate_size or self.moe_intermediate_size

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

    @classmethod
    def multimodal_tiny(cls, **changes: Any) -> ModelConfig:
        """``tiny`` plus a vision tower (4x4 patches, width 16, MLP 32; sentinel id 101) and an
        audio tower (8 mel bins, width 16, MLP 32; sentinel id 102), with a vocabulary of 103
        (the local tokenizer's 101 tokens plus ``<|image|>`` and ``<|audio|>``)."""
        base: dict[str, Any] = {
            "vocab_size": 103,
            "image_token_id": 101,
            "vision_patch_size": 4,
            "vision_hidden_size": 16,
            "vision_intermediate_size": 32,
            "audio_token_id": 102,
            "audio_num_mel_bins": 8,
            "audio_hidden_size": 16,
            "audio_intermediate_size": 32,
        }
        base.update(changes)
        return cls.tiny(**base)

    @classmethod
    def inkling_tiny(cls, **changes: Any) -> ModelConfig:
        """``tiny`` with every optional block on: layers 0 (dense) and 2 (MoE) slide over a
        window of 8 with 2 heads of dim 16 (1 KV head), layers 1 and 3 (MoE) are global;
        sconv width 4, relative bias (dim 4, extent 16), 1/head_dim scale, per-head q/k
        norms, sigmoid router with expert bias and 2 shared experts, embedding norm, logits
        divided by 2."""
        base: dict[str, Any] = {
            "sconv_kernel_size": 4,
            "rel_pos_dim": 4,
            "rel_pos_extent": 16,
            "sliding_window_layers": (0, 2),
            "sliding_window_size": 8,
            "swa_num_attention_heads": 2,
            "swa_num_key_value_heads": 1,
            "swa_head_dim": 16,
            "attention_softmax_scale": "inv_head_dim",
            "qk_norm_per_head": True,
            "router_score_function": "sigmoid",
            "n_shared_experts": 2,
            "shared_expert_intermediate_size": 16,
            "routed_scaling_factor": 2.5,
            "embedding_rms_norm": True,
            "logits_divisor": 2.0,
        }
        base.update(changes)
        return cls.tiny(**base)

    @classmethod
    def mla_tiny(cls, family: str = "glm4_moe_lite", **changes: Any) -> ModelConfig:
        """``tiny`` as an MLA family (``glm4_moe_lite`` or ``deepseek_v3``): 4 heads (kv heads =
        heads), query/kv latents of 16, nope 8 + rope 4 per head (``head_dim`` = the rope
        part), values of 12; layer 0 dense, then 4 routed experts (top 2) and one shared
        expert behind a sigmoid router scaled by 1.8."""
        base: dict[str, Any] = {
            "family": family,
            "qk_norm": False,
            **MLA_TINY_ATTENTION,
            "router_score_function": "sigmoid",
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.8,
        }
        base.update(changes)
        return cls.tiny(**base)

    @property
    def has_dense_and_moe_layers(self) -> bool:
        """Whether some layers are dense and some MoE (written as ``mellum``, see module doc)."""
        kinds = set(self.layer_types)
        return kinds == {"dense", "moe"}

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict in the family's own layout (``_families``)."""
        from posttrain.models._families import family_named

        return family_named(self.family).write(self)

    def to_qwen3_moe_family_dict(self) -> dict[str, Any]:
        """The Qwen3-MoE family's dict: ``qwen3_moe``, or ``mellum`` when dense and MoE layers
        mix, or ``posttrain_inkling`` (a ``qwen3_moe`` dict plus the block fields) when
        optional blocks are on."""
        if self.uses_extensions or self.has_towers:
            out = self.to_qwen3_moe_hf_dict()
            out["architectures"] = ["InklingForCausalLM"]
            out["model_type"] = "posttrain_inkling"
            for key in _EXTENSION_DEFAULTS:
                value = getattr(self, key)
                out[key] = list(value) if isinstance(value, tuple) else value
            if self.has_towers:
                out["architectures"] = ["PosttrainMultimodalForCausalLM"]
                out["model_type"] = "posttrain_multimodal"
                out.update({key: getattr(self, key) for key in _MULTIMODAL_DEFAULTS})
            return out
        if self.has_dense_and_moe_layers:
            return self._mellum_hf_dict()
        return self.to_qwen3_moe_hf_dict()

    def _mellum_hf_dict(self) -> dict[str, Any]:
        data = self.to_qwen3_moe_hf_dict()
        # mlp_only_layers / decoder_sparse_step stay as extra fields (SGLang and transformers
        # ignore them for mellum) so the config reads back field for field
        for key in ("rope_theta", "rope_scaling"):
            del data[key]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling.to_hf_dict(), "rope_theta": self.rope_theta}
        data.update(
            architectures=["MellumForCausalLM"],
            model_type="mellum",
            layer_types=["full_attention"] * self.num_hidden_layers,
            mlp_layer_types=["sparse" if t == "moe" else "dense" for t in self.layer_types],
            # only full_attention is used; MellumConfig validates both entries
            rope_parameters={"full_attention": dict(rope), "sliding_attention": dict(rope)},
        )
        del data["use_sliding_window"]
        return data

    def to_qwen3_moe_hf_dict(self) -> dict[str, Any]:
        """The ``qwen3_moe`` dict whatever the layers (dense ones in ``mlp_only_layers``).

        The layout this package wrote before ``mellum``: transformers (4 and 5) honour its dense
        layers, SGLang 0.5.23 does not. For tools that only know Qwen3-MoE.
        """
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
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
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
        """Read a ``config.json`` dict through the family gate (``_families``): what is not
        computed exactly raises a ModelConfigError naming the architecture and the feature."""
        from posttrain.models._families import config_from_hf

        return config_from_hf(data)


def qwen3_moe_kwargs(data: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a Qwen3-MoE, Mellum or posttrain ``config.json``."""
    data = dict(data)
    if data.get("model_type") == "mellum" or "mlp_layer_types" in data:
        data = _mellum_to_qwen3_moe(data)
    for key, ok in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("use_sliding_window", False),
    ):
        if key in data and data[key] not in (ok, None):
            raise ModelConfigError(f"{arch}: config.json {key}={data[key]!r} is not supported")
    data["rope_theta"], data["rope_scaling"] = read_rope(data, arch)
    if "num_experts" not in data and "num_local_experts" in data:
        data["num_experts"] = data["num_local_experts"]
    if "head_dim" not in data or data["head_dim"] is None:
        data["head_dim"] = data["hidden_size"] // data["num_attention_heads"]
    if "dtype" in data and "torch_dtype" not in data:
        data["torch_dtype"] = data["dtype"]
    skip = {"family", "qk_norm", "qkv_bias", "kv_capacity", *_MLA_FIELDS}
    names = {f.name for f in dataclasses.fields(ModelConfig)} - skip
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    for key in required:
        if key not in data:
            raise ModelConfigError(f"{arch}: config.json lacks the required field {key!r}")
    kwargs: dict[str, Any] = {k: data[k] for k in names if k in data}
    kwargs.setdefault("num_key_value_heads", data["num_attention_heads"])
    kwargs.setdefault("moe_intermediate_size", 0)
    kwargs.setdefault("num_experts", 0)
    kwargs.setdefault("num_experts_per_tok", 1)
    kwargs["mlp_only_layers"] = tuple(int(i) for i in kwargs.get("mlp_only_layers") or ())
    swa_layers = kwargs.get("sliding_window_layers") or ()
    if not isinstance(swa_layers, list | tuple):
        raise ModelConfigError(
            f"config.json sliding_window_layers={swa_layers!r} must be a list of layer indices"
        )
    kwargs["sliding_window_layers"] = tuple(swa_layers)
    kwargs["rope_theta"] = float(kwargs.get("rope_theta", 10000.0))
    if isinstance(kwargs.get("eos_token_id"), list):
        kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
    return kwargs


def _mellum_to_qwen3_moe(data: dict[str, Any]) -> dict[str, Any]:
    """A Mellum ``config.json`` dict in Qwen3-MoE fields; what the strict kernels lack is refused."""
    layers = data.get("num_hidden_layers")
    if not isinstance(layers, int):
        raise ModelConfigError("config.json lacks an integer num_hidden_layers")
    types = data.get("mlp_layer_types")
    if not isinstance(types, list) or len(types) != layers:
        raise ModelConfigError(
            f"config.json mlp_layer_types={types!r} must list one entry per layer ({layers})"
        )
    bad = sorted({t for t in types if t not in ("dense", "sparse")}, key=str)
    if bad:
        raise ModelConfigError(f"config.json mlp_layer_types holds {bad}; expected dense/sparse")
    attention = data.get("layer_types") or ["full_attention"] * layers
    if any(t != "full_attention" for t in attention):
        raise ModelConfigError(
            f"config.json layer_types={attention!r}: only full_attention is supported "
            "(sliding-window attention is not in the strict kernels)"
        )
    if data.get("num_mtp_layers"):
        raise ModelConfigError(f"config.json num_mtp_layers={data['num_mtp_layers']} unsupported")
    rope = (data.get("rope_parameters") or {}).get("full_attention") or {}
    out = {k: v for k, v in data.items() if k not in ("rope_parameters", "layer_types")}
    del out["mlp_layer_types"]
    out["rope_parameters"] = rope
    dense = [i for i, t in enumerate(types) if t == "dense"]
    if "mlp_only_layers" in data or "decoder_sparse_step" in data:  # written by to_hf_dict
        step = data.get("decoder_sparse_step", 1)
        only = set(data.get("mlp_only_layers") or ())
        implied = [
            i
            for i in range(layers)
            if i in only or not isinstance(step, int) or step <= 0 or (i + 1) % step
        ]
        if implied != dense:
            raise ModelConfigError(
                f"config.json mlp_only_layers={sorted(only)} and decoder_sparse_step={step} "
                f"make layers {implied} dense, but mlp_layer_types says {dense}"
            )
        return out
    out["mlp_only_layers"] = dense
    out["decoder_sparse_step"] = 1
    return out
