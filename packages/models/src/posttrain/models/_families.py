"""Model families: the gate between a Hugging Face ``config.json`` and ``ModelConfig``.

``config_from_hf`` dispatches on ``architectures`` (else ``model_type``) to a registered
``Family``, whose reader maps the HF fields onto the one decoder's switches (``qk_norm``,
``qkv_bias``, rope, experts, sliding window) and whose writer gives the family's own
``config.json`` back. Whatever a family cannot compute exactly is refused with a
``ModelConfigError`` naming the architecture and the feature: a rope type (``_rope``),
``partial_rotary_factor``, an activation, a bias, a sliding window, DeepSeek-V2's routing.

Families (same tensor names as Qwen3 in the HF layout; see ``_convert``):

    family     architecture          q/k norm  q/k/v bias  experts  rope
    qwen3      Qwen3ForCausalLM      yes       no          no       default, linear, llama3, yarn
    qwen3_moe  Qwen3MoeForCausalLM   yes       no          yes      (also Mellum and posttrain's own)
    qwen2      Qwen2ForCausalLM      no        yes         no       (Qwen2 and Qwen2.5)
    llama      LlamaForCausalLM      no        no          no       (Llama 3.x: llama3 rope)
    mistral    MistralForCausalLM    no        no          no       sliding_window on every layer

MLA families (``Family.mla``; every layer is a ``_model.MlaLayer``: ``_mla`` attention, then
a dense MLP on the leading ``first_k_dense_replace`` layers or a ``_ds_moe`` MoE):

    deepseek_v3    DeepseekV3ForCausalLM   group-limited sigmoid routing, first_k_dense_replace
    glm4_moe_lite  Glm4MoeLiteForCausalLM  (GLM-4.7-Flash) sigmoid routing, mlp_layer_types

Refused by name: DeepSeek-V2 (softmax / greedy routing), Gemma 2/3 (pre- and post-feedforward
norms, ``1 + weight`` norms, logit soft-capping, alternating windows: a second decoder).

A config with neither ``architectures`` nor ``model_type`` is read as Qwen3-MoE (the layout
this package wrote first). ``register_family`` adds a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from posttrain.models._errors import ModelConfigError
from posttrain.models._rope import read_rope

if TYPE_CHECKING:
    from posttrain.models._config import ModelConfig

Reader = Callable[[dict[str, Any], str], dict[str, Any]]
"""``(config.json dict, architecture) -> ModelConfig keyword arguments``."""
Writer = Callable[["ModelConfig"], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: its HF names, its fixed switches, its reader and writer."""

    name: str
    architecture: str
    model_type: str
    qk_norm: bool
    qkv_bias: bool
    experts: bool
    read: Reader
    write: Writer
    sliding_window: bool = False
    """Whether a window on every layer (Mistral's ``sliding_window``) is part of the family."""
    extensions: bool = False
    """Whether posttrain's optional blocks and towers may be on (the Qwen3-MoE family)."""
    mla: bool = False
    """Whether attention is MLA and MoE layers route DeepSeek-style (``_mla``, ``_ds_moe``)."""

    def check(self, config: ModelConfig) -> None:
        """Refuse a ``ModelConfig`` whose switches this family's layout cannot express."""
        where = f"ModelConfig(family={self.name!r})"
        if config.qk_norm != self.qk_norm:
            raise ModelConfigError(f"{where} needs qk_norm={self.qk_norm}")
        if config.qkv_bias != self.qkv_bias:
            raise ModelConfigError(f"{where} needs qkv_bias={self.qkv_bias}")
        if config.num_experts and not self.experts:
            raise ModelConfigError(f"{where} has no experts (num_experts={config.num_experts})")
        if config.is_mla != self.mla:
            raise ModelConfigError(
                f"{where} needs kv_lora_rank {'> 0 (MLA)' if self.mla else '= 0 (no MLA)'}"
            )
        if not self.mla and (config.n_group, config.topk_group) != (1, 1):
            raise ModelConfigError(f"{where} has no group-limited routing (n_group/topk_group)")
        if self.mla and config.num_experts:
            k = config.first_k_dense_replace
            if config.layer_types != ("dense",) * k + ("moe",) * (config.num_hidden_layers - k):
                raise ModelConfigError(
                    f"{where}: the dense layers must be the first ones (first_k_dense_replace), "
                    f"got layer types {list(config.layer_types)}"
                )
            if config.router_score_function != "sigmoid":
                raise ModelConfigError(f"{where} routes with sigmoid scores")
        if self.extensions:
            return
        if config.has_towers:
            raise ModelConfigError(f"{where} has no media towers")
        window_only = set(config.sliding_window_layers) == set(range(config.num_hidden_layers))
        for key in config.extension_fields_on():
            if self.mla and key in _MLA_ROUTING_FIELDS:
                continue
            if self.sliding_window and window_only and key == "sliding_window_layers":
                continue
            if self.sliding_window and window_only and key == "sliding_window_size":
                continue
            raise ModelConfigError(f"{where} does not take the optional block field {key}")


_MLA_ROUTING_FIELDS = ("router_score_function", "n_shared_experts", "routed_scaling_factor")
"""The optional-block fields that the MLA families' DeepSeek-style MoE layers hold."""

_FAMILIES: dict[str, Family] = {}
_BY_NAME: dict[str, str] = {}  # architecture or model_type -> family name
_REFUSED: dict[str, str] = {}  # architecture or model_type -> the missing feature

_MLA = (
    "DeepSeek-V2's MLA model (softmax or greedy routing, no e_score_correction_bias) is not "
    "supported (DeepSeek-V3 and GLM-4.x-MoE-Lite are)"
)
_GEMMA = (
    "the Gemma decoder (pre/post-feedforward layernorms, 1 + weight RMSNorm, logit "
    "soft-capping, alternating sliding windows) is not supported"
)
for _name in ("DeepseekV2ForCausalLM", "deepseek_v2"):
    _REFUSED[_name] = _MLA
for _name in (
    "Gemma2ForCausalLM",
    "gemma2",
    "Gemma3ForCausalLM",
    "gemma3_text",
    "Gemma3ForConditionalGeneration",
    "gemma3",
    "GemmaForCausalLM",
    "gemma",
):
    _REFUSED[_name] = _GEMMA


def register_family(family: Family, *aliases: str) -> None:
    """Add ``family``, found by its architecture, its model_type and ``aliases``."""
    _FAMILIES[family.name] = family
    for key in (family.architecture, family.model_type, *aliases):
        _BY_NAME[key] = family.name
        _REFUSED.pop(key, None)


def family_named(name: str) -> Family:
    """The registered family ``name``; a ModelConfigError lists the known ones."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ModelConfigError(
            f"ModelConfig.family={name!r} is not one of {sorted(_FAMILIES)}"
        ) from None


def supported_architectures() -> list[str]:
    """The HF architectures the gate accepts."""
    return sorted(f.architecture for f in _FAMILIES.values())


def architecture_of(data: Mapping[str, Any]) -> str:
    """The architecture a config names (first of ``architectures``, else its ``model_type``)."""
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    model_type = data.get("model_type")
    return model_type if isinstance(model_type, str) else ""


def config_from_hf(data: Mapping[str, Any]) -> ModelConfig:
    """The gate: a ``ModelConfig`` for a ``config.json`` dict, or a ModelConfigError naming
    the architecture and what is not supported."""
    from posttrain.models._config import ModelConfig

    arch = architecture_of(data)
    model_type = data.get("model_type")
    keys = [arch] if arch else []
    if isinstance(model_type, str):
        keys.append(model_type)
    for key in keys:
        if key in _REFUSED:
            raise ModelConfigError(f"{arch or key}: {_REFUSED[key]}")
    name = _BY_NAME.get(keys[0]) if keys else None  # the architecture decides when named
    if name is None:
        if keys:
            raise ModelConfigError(
                f"architecture {arch!r} (model_type {model_type!r}) is not supported; "
                f"supported: {supported_architectures()}"
            )
        name = "qwen3_moe"
        arch = "Qwen3MoeForCausalLM"
    family = _FAMILIES[name]
    kwargs = family.read(dict(data), arch)
    kwargs["family"] = family.name
    try:
        return ModelConfig(**kwargs)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{arch}: {exc}") from exc


# ---------------------------------------------------------------- shared reading helpers


def _refuse(arch: str, data: Mapping[str, Any], key: str, ok: tuple[Any, ...], what: str) -> None:
    if key in data and data[key] not in ok:
        raise ModelConfigError(f"{arch}: {key}={data[key]!r} ({what}) is not supported")


def _required(arch: str, data: Mapping[str, Any], *keys: str) -> None:
    for key in keys:
        if key not in data:
            raise ModelConfigError(f"{arch}: config.json lacks the required field {key!r}")


def _common(data: dict[str, Any], arch: str) -> dict[str, Any]:
    """Fields every family reads the same way (shape, norms, rope, ids, dtype)."""
    _required(arch, data, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    _required(arch, data, "num_attention_heads")
    _refuse(arch, data, "hidden_act", ("silu", None), "activation other than SiLU")
    theta, scaling = read_rope(data, arch)
    heads = data["num_attention_heads"]
    head_dim = data.get("head_dim")
    if head_dim is None:
        if not isinstance(heads, int) or not heads or data["hidden_size"] % heads:
            raise ModelConfigError(
                f"{arch}: hidden_size={data['hidden_size']} is not a multiple of "
                f"num_attention_heads={heads} and head_dim is not given"
            )
        head_dim = data["hidden_size"] // heads
    eos = data.get("eos_token_id")
    out: dict[str, Any] = {
        "vocab_size": data["vocab_size"],
        "hidden_size": data["hidden_size"],
        "intermediate_size": data["intermediate_size"],
        "num_hidden_layers": data["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": data.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "eos_token_id": eos[0] if isinstance(eos, list) and eos else eos,
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 0,
    }
    for key in (
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "initializer_range",
        "bos_token_id",
        "pad_token_id",
    ):
        if data.get(key) is not None:
            out[key] = data[key]
    dtype = data.get("torch_dtype", data.get("dtype"))
    if dtype is not None:
        out["torch_dtype"] = dtype
    return out


def _full_attention_only(data: Mapping[str, Any], arch: str) -> None:
    _refuse(arch, data, "use_sliding_window", (False, None), "sliding-window attention")
    types = data.get("layer_types")
    if types is not None and any(t != "full_attention" for t in types):
        raise ModelConfigError(
            f"{arch}: layer_types={types!r} (sliding-window layers) is not supported"
        )


def _hf_common(config: ModelConfig, family: Family) -> dict[str, Any]:
    """The fields of a dense family's ``config.json`` that all of them share."""
    rope = (
        {"rope_type": "default"}
        if config.rope_scaling is None
        else config.rope_scaling.to_hf_dict()
    )
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else rope,
        "attention_dropout": 0.0,
        "torch_dtype": config.torch_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }


# ---------------------------------------------------------------- dense families


def _read_qwen3(data: dict[str, Any], arch: str) -> dict[str, Any]:
    _refuse(arch, data, "attention_bias", (False, None), "biases on the attention projections")
    _full_attention_only(data, arch)
    _refuse(arch, data, "num_experts", (0, None), "experts (use Qwen3MoeForCausalLM)")
    return _common(data, arch) | {"qk_norm": True, "qkv_bias": False}


def _write_qwen3(config: ModelConfig) -> dict[str, Any]:
    return _write_qwen(config, "qwen3") | {"attention_bias": False}


def _write_qwen(config: ModelConfig, name: str) -> dict[str, Any]:
    """Qwen2's and Qwen3's shared fields: one full-attention type per layer, no window."""
    n = config.num_hidden_layers
    return _hf_common(config, _FAMILIES[name]) | {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
    }


def _read_qwen2(data: dict[str, Any], arch: str) -> dict[str, Any]:
    _full_attention_only(data, arch)
    return _common(data, arch) | {"qk_norm": False, "qkv_bias": True}


def _write_qwen2(config: ModelConfig) -> dict[str, Any]:
    return _write_qwen(config, "qwen2")


def _read_llama(data: dict[str, Any], arch: str) -> dict[str, Any]:
    _refuse(arch, data, "attention_bias", (False, None), "biases on the attention projections")
    _refuse(arch, data, "mlp_bias", (False, None), "biases on the MLP projections")
    _refuse(arch, data, "pretraining_tp", (1, None), "pretraining tensor-parallel slicing")
    return _common(data, arch) | {"qk_norm": False, "qkv_bias": False}


def _write_llama(config: ModelConfig) -> dict[str, Any]:
    out = _hf_common(config, _FAMILIES["llama"])
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return out


def _read_mistral(data: dict[str, Any], arch: str) -> dict[str, Any]:
    out = _common(data, arch) | {"qk_norm": False, "qkv_bias": False}
    window = data.get("sliding_window")
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ModelConfigError(f"{arch}: sliding_window={window!r} must be a positive int")
        out["sliding_window_layers"] = tuple(range(out["num_hidden_layers"]))
        out["sliding_window_size"] = window
    return out


def _write_mistral(config: ModelConfig) -> dict[str, Any]:
    out = _hf_common(config, _FAMILIES["mistral"])
    out["sliding_window"] = config.sliding_window_size or None
    return out


def _read_qwen3_moe(data: dict[str, Any], arch: str) -> dict[str, Any]:
    from posttrain.models._config import qwen3_moe_kwargs

    return qwen3_moe_kwargs(data, arch)


def _write_qwen3_moe(config: ModelConfig) -> dict[str, Any]:
    return config.to_qwen3_moe_family_dict()


register_family(
    Family(
        name="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        qk_norm=True,
        qkv_bias=False,
        experts=True,
        read=_read_qwen3_moe,
        write=_write_qwen3_moe,
        extensions=True,
    ),
    "MellumForCausalLM",
    "mellum",
    "InklingForCausalLM",
    "posttrain_inkling",
    "PosttrainMultimodalForCausalLM",
    "posttrain_multimodal",
)
# The dense families: (name = model_type, architecture, q/k norm, q/k/v bias, read, write).
_DENSE_FAMILIES: tuple[tuple[str, str, bool, bool, Reader, Writer], ...] = (
    ("qwen3", "Qwen3ForCausalLM", True, False, _read_qwen3, _write_qwen3),
    ("qwen2", "Qwen2ForCausalLM", False, True, _read_qwen2, _write_qwen2),
    ("llama", "LlamaForCausalLM", False, False, _read_llama, _write_llama),
    ("mistral", "MistralForCausalLM", False, False, _read_mistral, _write_mistral),
)
for _name, _arch, _qk_norm, _bias, _read, _write in _DENSE_FAMILIES:
    register_family(
        Family(
            name=_name,
            architecture=_arch,
            model_type=_name,
            qk_norm=_qk_norm,
            qkv_bias=_bias,
            experts=False,
            read=_read,
            write=_write,
            sliding_window=_name == "mistral",
        )
    )


# ---------------------------------------------------------------- MLA families


def _read_mla(data: dict[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4.x-MoE-Lite: MLA shapes, DeepSeek-style routing, dense-first layers."""
    from posttrain.models._ds_moe import DeepseekMoeSpec, mlp_layer_types
    from posttrain.models._mla_config import MlaSpec

    _required(arch, data, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    try:
        spec = MlaSpec.from_hf_dict(data)
        types = mlp_layer_types(data)
        moe = DeepseekMoeSpec.from_hf_dict(data) if "moe" in types else None
    except ModelConfigError as exc:
        raise ModelConfigError(f"{arch}: {exc}") from exc
    out = _common(data | {"head_dim": spec.qk_rope_head_dim}, arch)
    out |= {
        "qk_norm": False,
        "qkv_bias": False,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "rope_interleave": spec.rope.interleave,
        "rope_theta": spec.rope.rope_theta,
        "rope_scaling": spec.rope.scaling,
    }
    if moe is not None:
        out |= {
            "num_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.num_experts_per_tok,
            "moe_intermediate_size": moe.moe_intermediate_size,
            "n_shared_experts": moe.n_shared_experts,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "norm_topk_prob": moe.norm_topk_prob,
            "routed_scaling_factor": float(moe.routed_scaling_factor),
            "router_score_function": "sigmoid",
            "mlp_only_layers": tuple(i for i, t in enumerate(types) if t == "dense"),
        }
    return out


def _write_mla(config: ModelConfig, name: str) -> dict[str, Any]:
    out = _hf_common(config, _FAMILIES[name])
    n = config.num_hidden_layers
    out |= {
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "attention_bias": False,
        "pretraining_tp": 1,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size or config.intermediate_size,
        "n_shared_experts": config.n_shared_experts,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "norm_topk_prob": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }
    if name == "deepseek_v3":
        out["first_k_dense_replace"] = config.first_k_dense_replace if config.num_experts else n
        out["moe_layer_freq"] = 1
        out["num_nextn_predict_layers"] = 0
    else:
        out["first_k_dense_replace"] = config.first_k_dense_replace
        out["mlp_layer_types"] = ["sparse" if t == "moe" else "dense" for t in config.layer_types]
    return out


def _write_deepseek_v3(config: ModelConfig) -> dict[str, Any]:
    return _write_mla(config, "deepseek_v3")


def _write_glm4_moe_lite(config: ModelConfig) -> dict[str, Any]:
    return _write_mla(config, "glm4_moe_lite")


for _name, _arch, _write in (
    ("deepseek_v3", "DeepseekV3ForCausalLM", _write_deepseek_v3),
    ("glm4_moe_lite", "Glm4MoeLiteForCausalLM", _write_glm4_moe_lite),
):
    register_family(
        Family(
            name=_name,
            architecture=_arch,
            model_type=_name,
            qk_norm=False,
            qkv_bias=False,
            experts=True,
            read=_read_mla,
            write=_write,
            mla=True,
        )
    )
