"""``posttrain grpo --model-path DIR``: the user's own checkpoint, served and trained (issue 33).

A tiny Llama 3 (``llama3`` rope, no q/k norm), a tiny Qwen2.5 (q/k/v bias, tied embeddings)
and a tiny GLM-4.7-Flash (MLA, DeepSeek-style MoE; full and LoRA) checkpoint, each with the
local tokenizer, go through the whole command: the engines serve DIR,
the trainer trains it (full weights over SGLang's distributed update, or a LoRA adapter on the targets that exist
in that architecture), and the trainer's recomputed logprobs equal the engines' exactly at
every step. Kept short: two steps of 2 x 4 samples, one trainer rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpo_runs import records, run_grpo

from posttrain.models import (
    VOCAB_SIZE,
    ModelConfig,
    RopeScaling,
    build_model,
    build_tokenizer,
)

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(600)]

_DENSE = {
    "vocab_size": VOCAB_SIZE,
    "num_experts": 0,
    "mlp_only_layers": (),
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
    "qk_norm": False,
}
FAMILIES = {
    "llama3": ModelConfig.tiny(
        **_DENSE,
        family="llama",
        rope_theta=500000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3", factor=8.0, original_max_position_embeddings=16
        ),
    ),
    "qwen2.5": ModelConfig.tiny(
        **_DENSE, family="qwen2", qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6
    ),
    # MLA + DeepSeek-style MoE: a dense first layer, then 4 routed experts and a shared one
    "glm-4.7-flash": ModelConfig.mla_tiny(
        vocab_size=VOCAB_SIZE, num_hidden_layers=2, max_position_embeddings=64
    ),
}
SHORT = ("--steps", "2", "--context-length", "48")
TRAINER = ("--prompts-per-step", "2", "--samples-per-prompt", "4", "--shard", "1")


@pytest.mark.parametrize(
    ("family", "train"),
    [("llama3", "full"), ("qwen2.5", "lora"), ("glm-4.7-flash", "full"), ("glm-4.7-flash", "lora")],
    ids=["llama3-full", "qwen2.5-lora", "glm-4.7-flash-full", "glm-4.7-flash-lora"],
)
def test_grpo_trains_the_users_model(
    recipe_cache: Path, tmp_path: Path, family: str, train: str
) -> None:
    ckpt = tmp_path / "model"
    build_model(FAMILIES[family], seed=7).save_pretrained(ckpt, tokenizer=build_tokenizer())
    arch = json.loads((ckpt / "config.json").read_text())["architectures"]
    out = tmp_path / "run"
    summary = run_grpo(
        recipe_cache, out, "--model-path", str(ckpt), "--train", train, *SHORT, trainer=TRAINER
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_path"] == str(ckpt)
    assert config["train"] == train
    assert config["context_length"] == 48
    if train == "lora" and family == "glm-4.7-flash":  # MLA's projections, the dense MLP
        assert config["lora_targets"] == [
            "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
            "gate_proj", "up_proj", "down_proj",
        ]  # fmt: skip
    elif train == "lora":  # the recipe's targets that exist in a dense model: all seven
        assert config["lora_targets"] == [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
        ]  # fmt: skip
    steps = records(out)
    assert [r["step"] for r in steps] == [0, 1], arch
    for r in steps:
        assert r["train_rollout_logprob_abs_diff"] == 0.0, (arch, r)
        assert r["train_rollout_logprob_max_abs_diff"] == 0.0, (arch, r)
    assert summary["steps"] == 2
