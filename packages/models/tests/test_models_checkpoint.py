"""Model directories: safetensors + config.json round trips, tokenizer in the same dir, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from posttrain.models import (
    VOCAB_SIZE,
    CheckpointError,
    ModelConfig,
    ModelConfigError,
    Numerics,
    TensorSpecMismatchError,
    build_model,
    build_tokenizer,
    load_config,
    load_hf_tensors,
    load_pretrained,
    save_pretrained,
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip_is_exact(tmp_path: Path, dtype: str) -> None:
    cfg = ModelConfig.tiny(torch_dtype=dtype, max_position_embeddings=16)
    model = build_model(cfg, 1)
    save_pretrained(model, tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["config.json", "model.safetensors"]  # no temp files left behind
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    # dense layer 0 + MoE: the Mellum layout, whose per-layer MLP types SGLang builds as written
    assert data["architectures"] == ["MellumForCausalLM"]
    assert data["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert data["layer_types"] == ["full_attention"] * 4
    keys = set(load_hf_tensors(tmp_path / "ckpt"))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys

    loaded = load_pretrained(tmp_path / "ckpt", numerics=Numerics.FAST)
    assert loaded.config == cfg
    assert loaded.numerics is Numerics.FAST
    a, b = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == cfg.dtype
        assert torch.equal(a[name], b[name]), name


def test_layout_follows_the_layer_pattern_and_old_checkpoints_still_load(tmp_path: Path) -> None:
    all_moe = ModelConfig.tiny(mlp_only_layers=(), max_position_embeddings=16)
    assert all_moe.to_hf_dict()["model_type"] == "qwen3_moe"
    assert ModelConfig.tiny(num_experts=0).to_hf_dict()["model_type"] == "qwen3_moe"
    # a checkpoint written before the Mellum layout (qwen3_moe + mlp_only_layers) reads the same
    cfg = ModelConfig.tiny(max_position_embeddings=16)
    model = build_model(cfg, 2)
    save_pretrained(model, tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg.to_qwen3_moe_hf_dict()))
    old = load_pretrained(tmp_path / "old")
    assert old.config == cfg
    for name, value in model.named_parameters():
        assert torch.equal(dict(old.named_parameters())[name], value), name
    sliding = dict(cfg.to_hf_dict(), layer_types=["sliding_attention"] * 4)
    with pytest.raises(ModelConfigError, match="full_attention"):
        ModelConfig.from_hf_dict(sliding)
    with pytest.raises(ModelConfigError, match="dense/sparse"):
        ModelConfig.from_hf_dict(dict(cfg.to_hf_dict(), mlp_layer_types=["moe"] * 4))
    with pytest.raises(ModelConfigError, match="but mlp_layer_types says"):
        ModelConfig.from_hf_dict(dict(cfg.to_hf_dict(), mlp_only_layers=[1]))


def test_model_dir_is_a_tokenizer_path(tmp_path: Path) -> None:
    tok = build_tokenizer()
    model = build_model(ModelConfig.tiny(max_position_embeddings=16), 0)
    model.save_pretrained(tmp_path, tokenizer=tok)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "2+2?"}]
    text = again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = again(text).input_ids
    assert ids == tok(text).input_ids
    assert again.decode(ids) == text
    assert max(ids) < VOCAB_SIZE <= model.config.vocab_size
    assert again.eos_token == "<|im_end|>"
    assert again.eos_token_id == 3
    assert again.pad_token_id == 0
    assert again("é").input_ids == [again.unk_token_id]


def test_sharded_checkpoints_load(tmp_path: Path) -> None:
    cfg = ModelConfig.tiny(max_position_embeddings=16)
    model = build_model(cfg, 2)
    hf = {k: v.detach().contiguous() for k, v in model.hf_state_dict().items()}
    names = sorted(hf)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: hf[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    loaded = load_pretrained(tmp_path)
    for name, value in model.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], value)


def test_load_errors_name_the_file_or_tensor(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_config(tmp_path)
    cfg = ModelConfig.tiny(max_position_embeddings=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_pretrained(tmp_path)
    hf = build_model(cfg, 0).hf_state_dict()
    hf["model.norm.weight"] = hf["model.norm.weight"].to(torch.bfloat16)
    save_file(
        {k: v.detach().contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(TensorSpecMismatchError, match=r"model\.norm\.weight.*bfloat16"):
        load_pretrained(tmp_path)
    moe = cfg.replace(mlp_only_layers=()).to_hf_dict()  # qwen3_moe (no dense layer)
    bad = {**moe, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelConfigError, match=r"Qwen3MoeForCausalLM.*rope_type='dynamic'"):
        load_config(tmp_path)
