"""Exclusion lists: exact under SGLang's modelopt_fp4 rules, compact and explicit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.interface import ConfigError
from posttrain.quant_convert import CheckpointError, QuantPolicy, TensorInfo, plan_exclusions
from posttrain.quant_convert.selection import layer_prefix, select_tensors
from posttrain.quant_convert.sglang_rules import (
    build_modules,
    is_excluded,
    is_layer_excluded,
    is_layer_skipped,
)
from posttrain.quant_convert.testing import qwen3_moe_tensor_infos as qwen3_moe_names


def _check_exact(
    tensors: list[TensorInfo], quantized: frozenset[str], entries: tuple[str, ...]
) -> None:
    for m in build_modules(tensors):
        want = not any(w in quantized for w in m.weights)
        assert is_excluded(m, entries) == want, m.name


def test_qwen3_30b_a3b_shape_last_8_layers_bf16() -> None:
    tensors = qwen3_moe_names(48, 128)
    quantized = select_tensors(tensors, QuantPolicy(num_layers_at_end_in_bf16=8), 48)
    assert len(quantized) == 40 * 128 * 3
    compact = plan_exclusions(tensors, quantized, "compact")
    assert compact.entries == (
        "lm_head",
        "model.layers",
        *(f"model.layers.{i}.mlp.experts" for i in range(40, 48)),
    )
    explicit = plan_exclusions(tensors, quantized, "explicit")
    # per layer q/k/v/qkv/o/gate, embed_tokens, lm_head and 8 containers; miles wrote 499
    assert len(explicit.entries) == 48 * 6 + 2 + 8
    for plan in (compact, explicit):
        _check_exact(tensors, quantized, plan.entries)
    assert compact.excluded_modules == explicit.excluded_modules


def test_miles_compact_case_one_layer_all_bf16() -> None:
    tensors = [
        TensorInfo(f"model.layers.0.mlp.experts.{e}.{n}.weight", "BF16", (32, 32))
        for e in range(128)
        for n in ("gate_proj", "up_proj", "down_proj")
    ] + [TensorInfo("model.layers.0.input_layernorm.weight", "BF16", (32,))]
    quantized = select_tensors(tensors, QuantPolicy(num_layers_at_end_in_bf16=1), 1)
    assert quantized == frozenset()
    for style in ("compact", "explicit"):
        plan = plan_exclusions(tensors, quantized, style)  # type: ignore[arg-type]
        assert plan.entries == ("model.layers.0.mlp.experts",)


def test_sglang_rules_details() -> None:
    # glob on the whole prefix and on each component; dots literal
    assert is_layer_excluded("model.layers.3.mlp.experts", ["model.layers.3.*"])
    assert is_layer_excluded("model.layers.3.mlp.experts", ["experts"])
    assert not is_layer_excluded("model.layers.3.mlp.experts", ["model.layers.3."])
    assert not is_layer_excluded("model.layers.13.mlp.experts", ["model.layers.3.mlp.experts"])
    assert is_layer_excluded(
        "language_model.model.layers.1.mlp.experts", ["model.layers.1.mlp.experts"]
    )
    # path rule: dot boundaries, so mlp.gate does not catch mlp.gate_up_proj
    assert is_layer_skipped("model.layers.1.mlp.gate", ["mlp.gate"])
    assert not is_layer_skipped("model.layers.1.mlp.gate_up_proj", ["mlp.gate"])
    assert is_layer_skipped("model.layers.1.self_attn.o_proj", ["model.layers.1."])
    assert not is_layer_skipped("model.layers.11.self_attn.o_proj", ["model.layers.1"])
    # fused Linear decided on its shards, which must agree
    assert is_layer_skipped("model.layers.1.self_attn.qkv_proj", ["self_attn"])
    with pytest.raises(ValueError, match="some but not all shards"):
        is_layer_skipped("model.layers.1.self_attn.qkv_proj", ["model.layers.1.self_attn.q_proj"])


def test_keep_patterns_substring_regex_glob() -> None:
    p = QuantPolicy(keep_patterns=("mlp.experts.1.",))
    assert p.keeps("model.layers.0.mlp.experts.1.up_proj.weight")
    assert not p.keeps("model.layers.0.mlp.experts.10.up_proj.weight")
    assert QuantPolicy(keep_patterns=("mlp.experts.1",)).keeps("x.mlp.experts.17.w1.weight")
    assert QuantPolicy(keep_patterns=(r"re:layers\.2\.",)).keeps(
        "model.layers.2.mlp.experts.0.w1.weight"
    )
    assert QuantPolicy(keep_patterns=("glob:*.layers.[23].*",)).keeps(
        "model.layers.3.mlp.experts.0.w1.weight"
    )


def test_partial_fused_moe_and_layer_ranges_raise() -> None:
    tensors = qwen3_moe_names(2, 4)
    with pytest.raises(CheckpointError, match="partial FusedMoE"):
        select_tensors(tensors, QuantPolicy(keep_patterns=("mlp.experts.0.",)), 2)
    with pytest.raises(ConfigError, match="exceeds num_hidden_layers"):
        select_tensors(
            tensors, QuantPolicy(num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=1), 2
        )
    with pytest.raises(ConfigError, match=">= 0"):
        select_tensors(tensors, QuantPolicy(num_layers_at_start_in_bf16=-1), 2)


def test_gate_without_up_raises_naming_it() -> None:
    tensors = [
        t for t in qwen3_moe_names(1, 2) if t.name != "model.layers.0.mlp.experts.1.up_proj.weight"
    ]
    with pytest.raises(CheckpointError, match=r"experts\.1\.gate_proj.*without its up"):
        select_tensors(tensors, QuantPolicy(), 1)


def test_vlm_prefix_layer_detection() -> None:
    assert (
        layer_prefix("model.language_model.layers.12.mlp.experts.0.w1.weight")
        == "model.language_model.layers.12."
    )
    tensors = qwen3_moe_names(3, 2, prefix="model.language_model.")
    q = select_tensors(tensors, QuantPolicy(num_layers_at_start_in_bf16=1), 3)
    assert all(".layers.0." not in n for n in q)
    assert len(q) == 2 * 2 * 3


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 12),
    experts=st.integers(1, 3),
    start=st.integers(0, 3),
    end=st.integers(0, 3),
    dense=st.sets(st.integers(0, 11), max_size=3),
    shared=st.booleans(),
    include_shared=st.booleans(),
    keep_layer=st.none() | st.integers(0, 11),
    vlm=st.booleans(),
)
def test_both_styles_exact_on_random_models(
    layers: int,
    experts: int,
    start: int,
    end: int,
    dense: set[int],
    shared: bool,
    include_shared: bool,
    keep_layer: int | None,
    vlm: bool,
) -> None:
    start, end = min(start, layers), min(end, layers - min(start, layers))
    prefix = "model.language_model." if vlm else "model."
    tensors = qwen3_moe_names(layers, experts, prefix=prefix, dense=frozenset(dense), shared=shared)
    keep = () if keep_layer is None else (f"layers.{keep_layer}.mlp.",)
    policy = QuantPolicy(
        num_layers_at_start_in_bf16=start,
        num_layers_at_end_in_bf16=end,
        keep_patterns=keep,
        include_shared_experts=include_shared,
    )
    quantized = select_tensors(tensors, policy, layers)
    compact = plan_exclusions(tensors, quantized, "compact")
    explicit = plan_exclusions(tensors, quantized, "explicit")
    _check_exact(tensors, quantized, compact.entries)
    _check_exact(tensors, quantized, explicit.entries)
    assert len(compact.entries) <= len(explicit.entries)
