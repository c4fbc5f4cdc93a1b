"""Public surface, config mapping, input/cache/adapter errors, LoRA semantics and gradients."""

from __future__ import annotations

import pytest
import torch

import posttrain.models as models
from posttrain.interface import ConfigError, PosttrainError
from posttrain.models import (
    CacheError,
    KVCache,
    LoraAdapter,
    LoraError,
    ModelConfig,
    ModelConfigError,
    ModelInputError,
    Numerics,
    build_model,
)

CFG = ModelConfig.tiny(max_position_embeddings=16)


def test_all_is_exactly_the_public_surface() -> None:
    # ``posttrain.models.testing`` (test helpers, see the models README) becomes an
    # attribute of the package once some test imports it; it is not part of ``__all__``.
    entry_points = {"testing"}
    public = {n for n in dir(models) if not n.startswith("_")} - entry_points
    assert public == set(models.__all__)
    assert len(models.__all__) == len(set(models.__all__))


def test_errors_root_in_the_interface_tree() -> None:
    for name in models.__all__:
        obj = getattr(models, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, PosttrainError), name
    assert issubclass(ModelConfigError, ConfigError)
    assert issubclass(ModelInputError, ValueError)


def test_config_round_trips_through_hf_dict() -> None:
    assert ModelConfig.from_hf_dict(CFG.to_hf_dict()) == CFG
    assert CFG.layer_types == ("dense", "moe", "moe", "moe")
    assert ModelConfig.tiny(decoder_sparse_step=2, mlp_only_layers=()).layer_types == (
        "dense",
        "moe",
        "dense",
        "moe",
    )
    step2 = ModelConfig.tiny(decoder_sparse_step=2, mlp_only_layers=())
    assert ModelConfig.from_hf_dict(step2.to_hf_dict()) == step2
    hf_v5 = {
        **CFG.to_qwen3_moe_hf_dict(),
        "rope_parameters": {"rope_theta": 5e5},
        "num_local_experts": 4,
    }
    del hf_v5["rope_theta"], hf_v5["num_experts"]
    again = ModelConfig.from_hf_dict(hf_v5)
    assert again.rope_theta == 5e5
    assert again.num_experts == 4


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_key_value_heads": 3}, "num_attention_heads"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"mlp_only_layers": (7,)}, "mlp_only_layers"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"head_dim": 7}, "head_dim"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_config_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.tiny(**changes)


def test_forward_input_errors() -> None:
    model = build_model(CFG, 0)
    with pytest.raises(ModelInputError, match=r"input_ids\[2\]=500"):
        model.forward_logprobs(torch.tensor([1, 2, 500]), [3])
    with pytest.raises(ModelInputError, match="empty"):
        model.forward_logprobs(torch.tensor([], dtype=torch.long), [])
    with pytest.raises(ModelInputError, match="sum to 4"):
        model.forward_logprobs(torch.tensor([1, 2, 3]), [4])
    with pytest.raises(ModelInputError, match=r"segment_lengths\[0\]=17"):
        model.forward_logprobs(torch.ones(17, dtype=torch.long), [17])


def test_cache_errors_and_reset() -> None:
    model = build_model(CFG, 0)
    cache = model.new_kv_cache(2)
    with pytest.raises(CacheError, match="row 2"):
        model.prefill(cache, 2, [1])
    first = model.prefill(cache, 0, list(range(10)))
    with pytest.raises(CacheError, match="capacity 16"):
        model.prefill(cache, 0, list(range(7)))
    assert cache.lengths == [10, 0]
    with pytest.raises(CacheError, match="distinct"):
        model.extend(cache, [1, 1], [[1], [2]])
    cache.reset(0)
    again = model.prefill(cache, 0, list(range(10)))
    assert torch.equal(first.logprobs, again.logprobs)
    assert cache.lengths == [10, 0]


def test_copied_row_decodes_as_its_own_prefill() -> None:
    model = build_model(CFG, 0)
    cache = model.new_kv_cache(3)
    model.prefill(cache, 0, [4, 5, 6, 7])
    model.prefill(cache, 2, [4, 5, 6, 7])
    cache.copy_row(0, 1)
    assert cache.lengths == [4, 4, 4]
    step = model.decode_step(cache, [0, 1, 2], [9, 9, 9])
    assert torch.equal(step.logprobs[1], step.logprobs[2])  # the copy == its own prefill
    assert torch.equal(step.logprobs[0], step.logprobs[1])
    with pytest.raises(CacheError, match="row 3"):
        cache.copy_row(0, 3)
    held = sum(b.numel() * b.element_size() for b in (*cache.keys, *cache.values))
    assert KVCache.row_bytes(CFG) * cache.num_rows == held


def test_lora_is_base_plus_scaled_low_rank_delta() -> None:
    model = build_model(CFG, 0, numerics=Numerics.FAST)
    gen = torch.Generator().manual_seed(0)
    name = "model.layers.2.mlp.experts.1.up_proj"
    a = torch.randn(2, CFG.hidden_size, generator=gen)
    b = torch.randn(CFG.moe_intermediate_size, 2, generator=gen)
    ids = torch.randint(0, CFG.vocab_size, (12,), generator=gen)
    with torch.no_grad():
        lp_lora = model.forward_logprobs(
            ids, [12], lora=LoraAdapter(weights={name: (a, b)}, scaling=0.5)
        )
        params = dict(model.named_parameters())
        im = CFG.moe_intermediate_size
        params["layers.2.experts_fc1"][1, im:] += 0.5 * (b @ a)  # merge the delta
        lp_merged = model.forward_logprobs(ids, [12])
    assert torch.allclose(lp_lora, lp_merged, atol=1e-5)
    assert not torch.allclose(lp_lora, build_model(CFG, 0).forward_logprobs(ids, [12]), atol=1e-3)


def test_zero_b_adapter_changes_nothing_in_strict_mode() -> None:
    model = build_model(CFG, 0)
    targets = model.lora_targets()
    weights = {
        n: (torch.randn(3, d_in), torch.zeros(d_out, 3)) for n, (d_in, d_out) in targets.items()
    }
    ids = torch.randint(0, CFG.vocab_size, (10,))
    base = model.forward_logprobs(ids, [4, 6])
    same = model.forward_logprobs(ids, [4, 6], lora=LoraAdapter(weights=weights, scaling=2.0))
    assert torch.equal(base, same)


def test_lora_errors_name_the_module() -> None:
    model = build_model(CFG, 0)
    ids = torch.tensor([1, 2, 3])
    bad = LoraAdapter(
        weights={"model.layers.9.self_attn.q_proj": (torch.zeros(1, 32), torch.zeros(32, 1))},
        scaling=1.0,
    )
    with pytest.raises(LoraError, match=r"layers\.9"):
        model.forward_logprobs(ids, [3], lora=bad)
    shape = LoraAdapter(weights={"lm_head": (torch.zeros(2, 31), torch.zeros(128, 2))}, scaling=1.0)
    with pytest.raises(LoraError, match="lm_head"):
        model.forward_logprobs(ids, [3], lora=shape)
    with pytest.raises(LoraError, match="2 adapters for 1"):
        model.forward_logprobs(ids, [3], lora=[None, None])


def test_from_peft_state_dict() -> None:
    a, b = torch.zeros(2, 32), torch.zeros(32, 2)
    adapter = LoraAdapter.from_peft_state_dict(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
        },
        scaling=2.0,
    )
    assert set(adapter.weights) == {"model.layers.0.self_attn.q_proj"}
    with pytest.raises(LoraError, match="without its pair lora_B"):
        LoraAdapter.from_peft_state_dict({"base_model.model.lm_head.lora_A.weight": a}, scaling=1.0)
    with pytest.raises(LoraError, match="not a PEFT"):
        LoraAdapter.from_peft_state_dict({"model.lm_head.weight": a}, scaling=1.0)
    with pytest.raises(LoraError, match="not a PEFT"):  # the base_model.model. prefix is required
        LoraAdapter.from_peft_state_dict({"model.lm_head.lora_A.weight": a}, scaling=1.0)


def test_strict_gradients_match_fast_gradients() -> None:
    strict = build_model(CFG, 2)
    fast = build_model(CFG, 2, numerics=Numerics.FAST)
    ids = torch.randint(0, CFG.vocab_size, (20,), generator=torch.Generator().manual_seed(2))
    for model in (strict, fast):
        model.forward_logprobs(ids, [8, 12]).sum().backward()
    for (name, p), q in zip(strict.named_parameters(), fast.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=1e-4, rtol=1e-3), name
    assert float(strict.embedding.grad.abs().sum()) > 0  # type: ignore[union-attr]


def test_train_mode_equals_eval_mode() -> None:
    model = build_model(CFG, 3)
    ids = torch.randint(0, CFG.vocab_size, (9,))
    train = model.train().forward_logprobs(ids, [9])
    evals = model.eval().forward_logprobs(ids, [9])
    assert torch.equal(train, evals)
