"""Optional: SGLang's own model class builds our checkpoints as written and loads every tensor
(Qwen3-MoE / Mellum, each dense family: Qwen3, Qwen2.5, Llama 3, Mistral, and the MLA
families: DeepSeek-V3, GLM-4.7-Flash).

Runs where ``sglang`` imports: CI runs it in the side environment ``.ci/sglang-conformance``
builds (pinned sglang 0.5.23 ``--no-deps`` plus the light packages it imports), where it must
pass; the workspace's own suite skips it. For each checkpoint, a child process
(``sglang_load_probe.py``) resolves the class from ``config.json``'s ``architectures`` through
SGLang's registry, builds it on CPU (single-rank gloo), NaN-fills its parameters and runs its own
``load_weights`` on our ``model.safetensors``: every SGLang parameter must be written, every
checkpoint tensor used, and the fused tensors (``qkv_proj``, ``gate_up_proj``, ``w13``/``w2``)
must hold ours in SGLang's order. The negative control is the layout this package wrote before
``mellum``: SGLang's ``Qwen3MoeForCausalLM`` builds layer 0 as MoE, so its dense tensors go
unused and its experts stay unwritten.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.models import ModelConfig, build_model, save_pretrained

pytest.importorskip("sglang.srt.models.registry")

PROBE = Path(__file__).with_name("sglang_load_probe.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "default-dense-first": ({}, "MellumForCausalLM"),
    "bf16-sparse-step-2": (
        {"torch_dtype": "bfloat16", "decoder_sparse_step": 2, "mlp_only_layers": ()},
        "MellumForCausalLM",
    ),
    "all-moe": ({"mlp_only_layers": ()}, "Qwen3MoeForCausalLM"),
}
OLD_LAYOUT = "old-qwen3-moe-dense-first"
_DENSE: dict[str, Any] = {"num_experts": 0, "mlp_only_layers": ()}
_MLA: dict[str, Any] = {"num_experts": 8, "routed_scaling_factor": 2.5}  # over mla_tiny's
# Each family in its own HF layout (issues 33, 36), with the SGLang class that must take it.
FAMILY_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "qwen3-dense-tied": (
        {**_DENSE, "family": "qwen3", "tie_word_embeddings": True},
        "Qwen3ForCausalLM",
    ),
    "qwen3-yarn-bf16": (
        {**_DENSE, "family": "qwen3", "torch_dtype": "bfloat16", "rope_scaling": "yarn"},
        "Qwen3ForCausalLM",
    ),
    "qwen2.5-bias-tied": (
        {
            **_DENSE,
            "family": "qwen2",
            "qk_norm": False,
            "qkv_bias": True,
            "tie_word_embeddings": True,
        },
        "Qwen2ForCausalLM",
    ),
    "llama3": (
        {**_DENSE, "family": "llama", "qk_norm": False, "rope_scaling": "llama3"},
        "LlamaForCausalLM",
    ),
    # MLA + DeepSeek-style MoE (issue 36): SGLang's DeepseekV2 model code for both classes
    "deepseek-v3-yarn": (
        {**_MLA, "family": "deepseek_v3", "n_group": 2, "topk_group": 1, "rope_scaling": "yarn"},
        "DeepseekV3ForCausalLM",
    ),
    "deepseek-v3-no-q-lora": (
        {**_MLA, "family": "deepseek_v3", "q_lora_rank": None},
        "DeepseekV3ForCausalLM",
    ),
    "glm-4.7-flash": ({**_MLA, "family": "glm4_moe_lite"}, "Glm4MoeLiteForCausalLM"),
    "mistral-window": (
        {
            **_DENSE,
            "family": "mistral",
            "qk_norm": False,
            "sliding_window_layers": (0, 1, 2, 3),
            "sliding_window_size": 16,
        },
        "MistralForCausalLM",
    ),
}


def _family_config(changes: dict[str, Any]) -> ModelConfig:
    from posttrain.models import RopeScaling

    changes = dict(changes)
    rope = changes.pop("rope_scaling", None)
    if rope is not None:
        changes["rope_scaling"] = RopeScaling(
            rope_type=rope, factor=4.0, original_max_position_embeddings=16
        )
    if changes.get("family") in ("deepseek_v3", "glm4_moe_lite"):
        return ModelConfig.mla_tiny(**changes)
    return ModelConfig.tiny(**changes)


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case's checkpoint, probed in one child process (SGLang's imports cost ~1 min)."""
    root = tmp_path_factory.mktemp("sglang")
    for name, (changes, _) in CASES.items():
        save_pretrained(build_model(ModelConfig.tiny(**changes), seed=0), root / name)
    for name, (changes, _) in FAMILY_CASES.items():
        save_pretrained(build_model(_family_config(changes), seed=0), root / name)
    old = ModelConfig.tiny()
    save_pretrained(build_model(old, seed=0), root / OLD_LAYOUT)
    (root / OLD_LAYOUT / "config.json").write_text(json.dumps(old.to_qwen3_moe_hf_dict()))
    paths = [str(root / n) for n in [*CASES, *FAMILY_CASES, OLD_LAYOUT]]
    done = subprocess.run(
        [sys.executable, str(PROBE), str(_free_port()), *paths],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, dict[str, Any]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            path, _, payload = line.removeprefix("PROBE ").partition(" ")
            results[Path(path).name] = json.loads(payload)
    assert set(results) == {*CASES, *FAMILY_CASES, OLD_LAYOUT}, done.stdout[-2000:]
    return results


def _expected_sglang_params(cfg: ModelConfig) -> dict[str, list[int]]:
    """SGLang's fused parameter names and shapes for ``cfg`` (its Qwen3-MoE layer layout)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    out = {"model.embed_tokens.weight": [cfg.vocab_size, h], "model.norm.weight": [h]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [cfg.vocab_size, h]
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.qkv_proj.weight": [qkv, h],
            p + "self_attn.o_proj.weight": [h, cfg.num_attention_heads * hd],
            p + "self_attn.q_norm.weight": [hd],
            p + "self_attn.k_norm.weight": [hd],
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
        }
        if kind == "moe":
            e, im = cfg.num_experts, cfg.moe_intermediate_size
            out |= {
                p + "mlp.gate.weight": [e, h],
                p + "mlp.experts.w13_weight": [e, 2 * im, h],
                p + "mlp.experts.w2_weight": [e, h, im],
            }
        else:
            im = cfg.intermediate_size
            out |= {p + "mlp.gate_up_proj.weight": [2 * im, h], p + "mlp.down_proj.weight": [h, im]}
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_sglang_builds_and_loads_our_checkpoint_exactly(
    probed: dict[str, dict[str, Any]], name: str
) -> None:
    changes, architecture = CASES[name]
    result = probed[name]
    assert result["architecture"] == architecture
    assert result["params"] == _expected_sglang_params(ModelConfig.tiny(**changes))
    assert result["unwritten"] == []
    assert result["unused"] == []
    assert result["fused_ok"], result["fused_bad"]


@pytest.mark.parametrize("name", sorted(FAMILY_CASES))
def test_sglang_loads_each_family_as_we_write_it(
    probed: dict[str, dict[str, Any]], name: str
) -> None:
    """Qwen3 (tied, YaRN), Qwen2.5 (q/k/v bias), Llama 3, Mistral, DeepSeek-V3 (YaRN, no query
    latent) and GLM-4.7-Flash: SGLang's class for the architecture we write builds it and every
    parameter is written from exactly our tensors."""
    changes, architecture = FAMILY_CASES[name]
    result = probed[name]
    assert result["architecture"] == architecture
    assert result["unwritten"] == []
    assert result["unused"] == []
    assert result["fused_ok"], result["fused_bad"]
    cfg = _family_config(changes)
    assert ("model.layers.0.self_attn.qkv_proj.bias" in result["params"]) is cfg.qkv_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in result["params"]) is cfg.qk_norm
    if cfg.is_mla:  # SGLang fuses [q_a; kv_a] only with a query latent
        fused = "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in result["params"]
        assert fused is (cfg.q_lora_rank is not None)
        assert "model.layers.1.mlp.experts.w13_weight" in result["params"]
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in result["params"]


def test_old_qwen3_moe_layout_with_a_dense_layer_does_not_load_in_sglang(
    probed: dict[str, dict[str, Any]],
) -> None:
    result = probed[OLD_LAYOUT]
    assert result["architecture"] == "Qwen3MoeForCausalLM"
    assert "model.layers.0.mlp.experts.w13_weight" in result["unwritten"]
    assert "model.layers.0.mlp.gate_proj.weight" in result["unused"]
    assert not result["fused_ok"]
