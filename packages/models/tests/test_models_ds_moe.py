"""DeepSeek-style MoE (``_ds_moe``): transformers' ``DeepseekV3MoE`` / ``Glm4MoeLiteMoE`` on the same
weights pick the same experts with the same weights, and the block's output agrees.

Stated tolerance: outputs within 1e-5 absolute (fp32), routing weights within 1e-6, expert ids
equal. Observed: about 1e-6 and 1e-7.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from transformers import DeepseekV3Config, Glm4MoeLiteConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3MoE,
)
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteDecoderLayer,
    Glm4MoeLiteMoE,
)

from posttrain.models import FastOps, ModelConfigError, StrictOps, UnknownTensorError
from posttrain.models._ds_moe import (
    DeepseekMoe,
    DeepseekMoeSpec,
    group_limit_bias,
    mlp_layer_types,
    swiglu_mlp,
)

TOLERANCE = 1e-5
H = 32
CASES: dict[str, tuple[type, dict[str, Any]]] = {
    # 4 groups of 4, 2 groups kept: the group limit changes the choice for many tokens
    "deepseek-grouped": (
        DeepseekV3Config,
        {
            "n_routed_experts": 16,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
            "n_shared_experts": 2,
            "routed_scaling_factor": 2.5,
        },
    ),
    "deepseek-unnormalised": (
        DeepseekV3Config,
        {
            "n_routed_experts": 8,
            "n_group": 2,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.5,
        },
    ),
    "glm4-moe-lite": (
        Glm4MoeLiteConfig,
        {
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.8,
            "num_hidden_layers": 2,
        },
    ),
}


def hf_moe(name: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    cls, fields = CASES[name]
    cfg = cls(hidden_size=H, moe_intermediate_size=10, **fields)
    cfg._experts_implementation = "eager"
    module = (DeepseekV3MoE if cls is DeepseekV3Config else Glm4MoeLiteMoE)(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        bias = module.gate.e_score_correction_bias
        bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    return module.eval(), cfg.to_dict()


def ours(name: str) -> tuple[DeepseekMoe, torch.nn.Module]:
    hf, config = hf_moe(name)
    module = DeepseekMoe(DeepseekMoeSpec.from_hf_dict(config))
    module.load_hf_state_dict(hf.state_dict())
    return module, hf


def tokens(n: int, seed: int = 1) -> Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numerics", [FastOps, StrictOps], ids=["fast", "strict"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_routing_and_output_match_transformers(name: str, numerics: type[FastOps]) -> None:
    module, hf = ours(name)
    x = tokens(64)
    with torch.no_grad():
        ref = hf(x[None])[0]
        _, hf_weights, hf_ids = hf.gate(x)
        ids, weights = module.route(numerics, x)
        out = module(numerics, x)
    hf_sorted, order = hf_ids.sort(dim=-1)
    assert torch.equal(ids, hf_sorted)
    assert float((weights - hf_weights.gather(1, order)).abs().max()) < 1e-6
    assert float((out - ref).abs().max()) < TOLERANCE


def test_group_limit_and_correction_bias_both_change_the_choice() -> None:
    module, _ = ours("deepseek-grouped")
    x = tokens(64)
    with torch.no_grad():
        logits = StrictOps.linear(x, module.router)
        ids, _ = module.route(StrictOps, x)
    scores = torch.sigmoid(logits)
    ungrouped = (scores + module.expert_bias).topk(3, dim=-1).indices.sort(-1).values
    unbiased_choice = scores.topk(3, dim=-1).indices.sort(-1).values
    assert (ids != ungrouped).any(dim=1).sum() > 5  # the tests above would see a missing limit
    assert (ids != unbiased_choice).any(dim=1).sum() > 5  # ... and an ignored correction bias
    assert max(torch.unique(row // 4).numel() for row in ids) <= 2  # within topk_group groups


def test_ties_go_to_the_lower_group_and_expert() -> None:
    choice = torch.zeros(2, 16)
    bias = group_limit_bias(choice, 4, 2)
    assert torch.equal(torch.isinf(bias[0]), torch.arange(16) >= 8)  # groups 0 and 1 kept
    module, _ = ours("deepseek-grouped")
    with torch.no_grad():
        module.router.zero_()
        module.expert_bias.zero_()
        ids, weights = module.route(StrictOps, tokens(3))
    assert ids.tolist() == [[0, 1, 2]] * 3
    assert torch.allclose(weights, torch.full((3, 3), 2.5 / 3))


def test_strict_combine_is_shared_first_then_ascending_expert_ids() -> None:
    module, _ = ours("deepseek-grouped")
    x = tokens(16)
    with torch.no_grad():
        ids, weights = module.route(StrictOps, x)
        out = module(StrictOps, x)
        for t in range(x.shape[0]):
            row = x[t : t + 1]
            acc = swiglu_mlp(StrictOps, module.shared_fc1, module.shared_fc2, row)
            for slot, j in enumerate(ids[t].tolist()):
                y = swiglu_mlp(StrictOps, module.experts_fc1[j], module.experts_fc2[j], row)
                acc = acc + weights[t, slot] * y
            assert torch.equal(acc[0], out[t])


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 24), seed=st.integers(0, 10_000), data=st.data())
def test_strict_rows_do_not_depend_on_the_batch(n: int, seed: int, data: st.DataObject) -> None:
    module, _ = ours("deepseek-grouped")
    x = tokens(n, seed) * 3
    with torch.no_grad():
        full = module(StrictOps, x)
        ids, weights = module.route(StrictOps, x)
        i = data.draw(st.integers(0, n - 1))
        one_ids, one_weights = module.route(StrictOps, x[i : i + 1])
        assert torch.equal(one_ids[0], ids[i])
        assert torch.equal(one_weights[0], weights[i])
        assert torch.equal(module(StrictOps, x[i : i + 1])[0], full[i])
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(module(StrictOps, x[perm]), full[perm])


def test_gradients_reach_router_and_experts() -> None:
    module, hf = ours("glm4-moe-lite")
    x = tokens(12)
    hf(x[None]).square().sum().backward()
    module(StrictOps, x).square().sum().backward()
    assert module.router.grad is not None
    assert float((module.router.grad - hf.gate.weight.grad).abs().max()) < 1e-4
    assert module.experts_fc1.grad is not None
    assert float((module.experts_fc1.grad - hf.experts.gate_up_proj.grad).abs().max()) < 1e-4
    assert module.expert_bias.grad is None  # selection only: never trained by the loss


def test_weights_round_trip_and_refusals() -> None:
    module, hf = ours("deepseek-grouped")
    state = hf.state_dict()
    assert set(module.hf_state_dict()) == set(state)
    assert all(torch.equal(module.hf_state_dict()[k], v) for k, v in state.items())
    assert module.router.dtype == torch.float32
    assert module.expert_bias.dtype == torch.float32
    with pytest.raises(UnknownTensorError, match=r"shared_experts\.0"):
        module.load_hf_state_dict({**state, "shared_experts.0.gate_proj.weight": torch.zeros(1)})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_group": 3}, "multiple of n_group"),
        ({"n_group": 16, "topk_group": 2}, "1 expert per group"),
        ({"topk_group": 5}, "exceeds n_group"),
        ({"num_experts_per_tok": 9}, "exceeds the 8 experts"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
        ({"n_routed_experts": 0}, "n_routed_experts"),
    ],
)
def test_spec_refuses_by_name(change: dict[str, Any], needle: str) -> None:
    _, config = hf_moe("deepseek-grouped")
    with pytest.raises(ModelConfigError, match=needle):
        DeepseekMoeSpec.from_hf_dict({**config, **change})


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (DeepseekV3Config, {}),  # first_k_dense_replace defaults to 3
        (DeepseekV3Config, {"first_k_dense_replace": 1}),
        (DeepseekV3Config, {"first_k_dense_replace": 0}),
        (Glm4MoeLiteConfig, {}),  # dense first, then sparse
        (Glm4MoeLiteConfig, {"mlp_layer_types": ["dense", "dense", "sparse", "dense", "sparse"]}),
    ],
)
def test_layer_types_are_transformers_layers(cls: type, fields: dict[str, Any]) -> None:
    cfg = cls(
        hidden_size=H,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        **fields,
    )
    layer_cls = DeepseekV3DecoderLayer if cls is DeepseekV3Config else Glm4MoeLiteDecoderLayer
    moe_cls = DeepseekV3MoE if cls is DeepseekV3Config else Glm4MoeLiteMoE
    hf_types = tuple(
        "moe" if isinstance(layer_cls(cfg, i).mlp, moe_cls) else "dense" for i in range(5)
    )
    config = cfg.to_dict()
    for key in [k for k, v in config.items() if v is None]:
        del config[key]  # a saved config.json may omit what the class defaults
    assert mlp_layer_types(config) == hf_types


def test_layer_types_refuse_what_reads_two_ways() -> None:
    base = {"model_type": "glm4_moe_lite", "num_hidden_layers": 3, "n_routed_experts": 4}
    assert mlp_layer_types({**base, "first_k_dense_replace": 1}) == ("dense", "moe", "moe")
    with pytest.raises(ModelConfigError, match="disagrees with first_k_dense_replace=2"):
        mlp_layer_types({**base, "first_k_dense_replace": 2})
    with pytest.raises(ModelConfigError, match="moe_layer_freq=2"):
        mlp_layer_types({**base, "model_type": "deepseek_v3", "moe_layer_freq": 2})
    with pytest.raises(ModelConfigError, match="mlp_layer_types"):
        mlp_layer_types({**base, "mlp_layer_types": ["dense", "sparse"]})
    with pytest.raises(ModelConfigError, match="qwen3_moe"):
        mlp_layer_types({**base, "model_type": "qwen3_moe"})
    assert mlp_layer_types({**base, "n_routed_experts": 0}) == ("dense",) * 3
