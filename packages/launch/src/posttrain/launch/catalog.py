"""The models ``posttrain plan --model`` knows: ids, families, and the shapes rules check.

Only the numbers a launch rule needs are kept (attention heads for the TP check, layers and
experts for trainer flags). A model id is what a user types; a family is what rules branch on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from posttrain.launch._errors import LaunchConfigError


class ModelFamily(StrEnum):
    GLM4_MOE_LITE = "glm4-moe-lite"  # GLM-4.7-Flash: MLA attention, first layer dense
    QWEN3_MOE = "qwen3-moe"
    QWEN3 = "qwen3"  # dense


class Attention(StrEnum):
    MLA = "mla"  # multi-head latent attention (DeepSeek-style), served by MLA kernels
    GQA = "gqa"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model a plan can be made for. ``hf_id`` is informative; plans take a local path."""

    id: str
    family: ModelFamily
    hf_id: str
    attention: Attention
    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int
    num_experts: int  # 0 for dense models
    first_k_dense: int = 0  # leading dense layers of a MoE model

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_freq(self) -> str:
        """Megatron's ``--moe-layer-freq`` as a Python list expression, e.g. ``[0]*1+[1]*46``.

        It contains ``*`` and ``[``: it must travel as one argv token (never through a shell).
        """
        moe = self.num_layers - self.first_k_dense
        return f"[0]*{self.first_k_dense}+[1]*{moe}" if self.first_k_dense else f"[1]*{moe}"


MODELS: dict[str, ModelSpec] = {
    spec.id: spec
    for spec in (
        ModelSpec(
            id="glm-4.7-flash",
            family=ModelFamily.GLM4_MOE_LITE,
            hf_id="zai-org/GLM-4.7-Flash",
            attention=Attention.MLA,
            num_attention_heads=20,
            num_key_value_heads=20,
            num_layers=47,
            num_experts=64,
            first_k_dense=1,
        ),
        ModelSpec(
            id="qwen3-30b-a3b",
            family=ModelFamily.QWEN3_MOE,
            hf_id="Qwen/Qwen3-30B-A3B",
            attention=Attention.GQA,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_layers=48,
            num_experts=128,
        ),
        ModelSpec(
            id="qwen3-235b-a22b",
            family=ModelFamily.QWEN3_MOE,
            hf_id="Qwen/Qwen3-235B-A22B",
            attention=Attention.GQA,
            num_attention_heads=64,
            num_key_value_heads=4,
            num_layers=94,
            num_experts=128,
        ),
        ModelSpec(
            # The tiny Qwen3-MoE-layout checkpoint the `models` package builds for CPU tests.
            id="posttrain-tiny-moe",
            family=ModelFamily.QWEN3_MOE,
            hf_id="posttrain/tiny-qwen3-moe",
            attention=Attention.GQA,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_layers=2,
            num_experts=4,
        ),
        ModelSpec(
            id="qwen3-8b",
            family=ModelFamily.QWEN3,
            hf_id="Qwen/Qwen3-8B",
            attention=Attention.GQA,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_layers=36,
            num_experts=0,
        ),
    )
}


def mla_lora_targets(wanted: list[str], *, q_lora: bool = True) -> list[str]:
    """LoRA target names for an MLA model (DeepSeek-V3, GLM-4.x-MoE-Lite), which has no
    ``k_proj``/``v_proj``: ``q_proj`` is ``q_a_proj`` + ``q_b_proj`` with a query latent
    (``q_lora``), ``k_proj``/``v_proj`` are ``kv_a_proj_with_mqa`` + ``kv_b_proj``; other
    names stay. Order kept, duplicates dropped."""
    q = ["q_a_proj", "q_b_proj"] if q_lora else ["q_proj"]
    kv = ["kv_a_proj_with_mqa", "kv_b_proj"]
    mla = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    return list(dict.fromkeys(n for t in wanted for n in mla.get(t, [t])))


def get_model(model_id: str) -> ModelSpec:
    """Look a model id up; the error lists the ids that exist."""
    try:
        return MODELS[model_id.strip().lower()]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise LaunchConfigError(f"model {model_id!r} is not one of: {known}") from None
