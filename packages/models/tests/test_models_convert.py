"""HF <-> in-memory weight-name conversion: every tensor used exactly once, exact round trips."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.models import (
    DuplicateTensorError,
    MissingTensorError,
    ModelConfig,
    TensorSpecMismatchError,
    UnknownTensorError,
    build_model,
    from_hf_state_dict,
    to_hf_state_dict,
    weight_groups,
)


@st.composite
def configs(draw: st.DrawFn) -> ModelConfig:
    layers = draw(st.integers(1, 3))
    kv = draw(st.sampled_from([1, 2]))
    experts = draw(st.sampled_from([0, 2, 3, 4]))
    return ModelConfig(
        vocab_size=draw(st.integers(5, 40)),
        hidden_size=draw(st.sampled_from([8, 12, 16])),
        intermediate_size=draw(st.integers(1, 24)),
        num_hidden_layers=layers,
        num_attention_heads=kv * draw(st.integers(1, 3)),
        num_key_value_heads=kv,
        head_dim=draw(st.sampled_from([2, 4, 6])),
        moe_intermediate_size=draw(st.integers(1, 12)),
        num_experts=experts,
        num_experts_per_tok=min(2, experts) if experts else 1,
        decoder_sparse_step=draw(st.integers(1, 2)),
        mlp_only_layers=tuple(draw(st.sets(st.integers(0, layers - 1)))),
        tie_word_embeddings=draw(st.booleans()),
        torch_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        max_position_embeddings=8,
    )


@settings(max_examples=25, deadline=None)
@given(cfg=configs(), seed=st.integers(0, 2**16), stacked=st.booleans())
def test_round_trip_uses_every_tensor_exactly_once(
    cfg: ModelConfig, seed: int, stacked: bool
) -> None:
    model = build_model(cfg, seed)
    params = {k: v.detach() for k, v in model.named_parameters()}
    groups = weight_groups(cfg)
    assert sorted(g.name for g in groups) == sorted(params)  # one group per parameter
    counts = Counter(n for g in groups for n in g.hf_names)
    assert all(c == 1 for c in counts.values())

    hf = to_hf_state_dict(params, cfg, stacked_experts=stacked)
    if not stacked:
        assert set(hf) == set(counts)
    for g in groups:
        for name, shape in zip(g.hf_names, g.hf_shapes, strict=True):
            if name in hf:
                assert tuple(hf[name].shape) == shape
    experts = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * cfg.num_experts
    assert sum(".experts." in n and n.endswith(".weight") for n in hf) == (
        0 if stacked else 3 * experts
    )

    back = from_hf_state_dict(hf, cfg)
    assert sorted(back) == sorted(params)
    for name, value in params.items():
        assert torch.equal(back[name], value), name
    # values are untouched: every element of every HF tensor appears in exactly one place
    assert sum(v.numel() for v in hf.values()) == sum(v.numel() for v in params.values())


@settings(max_examples=15, deadline=None)
@given(cfg=configs(), pick=st.integers(0, 10_000))
def test_bad_inputs_are_named(cfg: ModelConfig, pick: int) -> None:
    hf = to_hf_state_dict(dict(build_model(cfg, 0).named_parameters()), cfg)
    names = sorted(hf)
    victim = names[pick % len(names)]

    dropped = {k: v for k, v in hf.items() if k != victim}
    with pytest.raises(MissingTensorError, match=victim.replace(".", r"\.")):
        from_hf_state_dict(dropped, cfg)
    with pytest.raises(UnknownTensorError, match=r"model\.extra"):
        from_hf_state_dict({**hf, "model.extra.weight": hf[victim]}, cfg)
    with pytest.raises(DuplicateTensorError, match=victim.replace(".", r"\.")):
        from_hf_state_dict([*hf.items(), (victim, hf[victim])], cfg)
    wrong = torch.float16 if cfg.torch_dtype != "float16" else torch.float32
    with pytest.raises(TensorSpecMismatchError, match="dtype"):
        from_hf_state_dict({**hf, victim: hf[victim].to(wrong)}, cfg)
    with pytest.raises(TensorSpecMismatchError, match="shape"):
        from_hf_state_dict({**hf, victim: hf[victim].reshape(-1)[:-1]}, cfg)


def test_partial_updates_take_whole_groups_only() -> None:
    cfg = ModelConfig.tiny(max_position_embeddings=8)
    hf = to_hf_state_dict(dict(build_model(cfg, 0).named_parameters()), cfg)
    qkv = {
        k: v for k, v in hf.items() if k.startswith("model.layers.1.self_attn.") and "_proj" in k
    }
    out = from_hf_state_dict({k: v for k, v in qkv.items() if "o_proj" not in k}, cfg, partial=True)
    assert list(out) == ["layers.1.qkv"]
    with pytest.raises(MissingTensorError, match=r"layers\.1\.qkv"):
        from_hf_state_dict(
            {
                "model.layers.1.self_attn.q_proj.weight": qkv[
                    "model.layers.1.self_attn.q_proj.weight"
                ]
            },
            cfg,
            partial=True,
        )


def test_stacked_and_per_expert_forms_together_are_refused() -> None:
    cfg = ModelConfig.tiny(max_position_embeddings=8)
    params = dict(build_model(cfg, 0).named_parameters())
    hf = to_hf_state_dict(params, cfg)
    stacked = to_hf_state_dict(params, cfg, stacked_experts=True)
    both = {
        **hf,
        "model.layers.1.mlp.experts.down_proj": stacked["model.layers.1.mlp.experts.down_proj"],
    }
    with pytest.raises(DuplicateTensorError, match=r"experts\.down_proj"):
        from_hf_state_dict(both, cfg)
