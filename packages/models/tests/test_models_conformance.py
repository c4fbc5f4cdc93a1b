"""Conformance: transformers on the same checkpoint, both directions.

A checkpoint with dense and MoE layers is written as ``mellum`` (SGLang 0.5.23's
``Qwen3MoeForCausalLM`` builds every layer as MoE; see ``_config``) and loads as
``MellumForCausalLM``; one without is ``qwen3_moe``. Both are compared with our forward, and
today's ``qwen3_moe`` + ``mlp_only_layers`` checkpoints still load into ours.

Stated tolerance: logits agree within 2e-5 absolute (fp32 weights and activations; logits
are O(1)), in strict and in fast mode. Observed on the tiny configs: about 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from posttrain.models import DecoderModel, ModelConfig, Numerics, build_model, load_pretrained

TOLERANCE = 2e-5

CONFIGS = {
    "dense-first": ModelConfig.tiny(max_position_embeddings=32),
    "tied-sparse-step-2": ModelConfig.tiny(
        max_position_embeddings=32,
        tie_word_embeddings=True,
        decoder_sparse_step=2,
        mlp_only_layers=(),
    ),
    "bf16-params-unnormed-top3": ModelConfig.tiny(
        max_position_embeddings=32,
        torch_dtype="bfloat16",
        norm_topk_prob=False,
        num_experts_per_tok=3,
    ),
}


def hf_logits(model: Qwen3MoeForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def ours(model: DecoderModel, ids: torch.Tensor, numerics: Numerics) -> torch.Tensor:
    model.numerics = numerics
    with torch.no_grad():
        return model.forward_logits(ids, [ids.shape[0]])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_loads_our_checkpoint(tmp_path: Path, name: str) -> None:
    cfg = CONFIGS[name]
    model = build_model(cfg, 4)
    model.save_pretrained(tmp_path)
    hf, info = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, output_loading_info=True
    )
    expected = "MellumForCausalLM" if cfg.has_dense_and_moe_layers else "Qwen3MoeForCausalLM"
    assert type(hf).__name__ == expected
    assert [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers] == [
        t == "moe" for t in cfg.layer_types
    ]
    # Every tensor of ours lands on one of transformers' parameters, and none is left random.
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf, ids)
    for numerics in Numerics:
        diff = float((ours(model, ids, numerics) - ref).abs().max())
        assert diff < TOLERANCE, (numerics, diff)


def test_we_load_a_transformers_checkpoint_and_its_in_memory_state(tmp_path: Path) -> None:
    cfg = CONFIGS["dense-first"]
    fields = {
        k: v
        for k, v in cfg.to_qwen3_moe_hf_dict().items()
        if k not in ("architectures", "model_type")
    }
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).eval()
    hf.save_pretrained(str(tmp_path))
    from_disk = load_pretrained(tmp_path)  # per-expert keys and HF v5 config spelling
    in_memory = DecoderModel(cfg)
    in_memory.load_hf_state_dict(dict(hf.state_dict()))  # stacked experts.gate_up_proj form
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, ids)
    for model in (from_disk, in_memory):
        assert float((ours(model, ids, Numerics.STRICT) - ref).abs().max()) < TOLERANCE
