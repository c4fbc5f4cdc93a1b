"""The family gate against transformers: 15 tiny checkpoints written by transformers' own config
and model classes (2 layers, random init).

Each supported one loads into ours with per-token logprobs within 1e-5 of transformers' fp32
forward (strict and fast), strict training logprobs equal KV-cache decode bit for bit, and
what we save loads back into transformers with every tensor used. Each unsupported one is
refused at config reading (what ``--dry-run`` applies) with an error naming the architecture
and the missing feature.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from posttrain.models import (
    ModelConfig,
    ModelConfigError,
    Numerics,
    load_config,
    load_pretrained,
)
from posttrain.models.parity import decoded_logprobs, packed_logprobs
from posttrain.models.testing import HF_MLA, HF_TINY, hf_config

TOLERANCE = 1e-5


def _legacy_rope(path: Path) -> None:
    """Rewrite ``config.json`` the transformers-4 way: ``rope_theta`` + ``rope_scaling`` with
    the old ``type`` key."""
    file = path / "config.json"
    data = json.loads(file.read_text())
    params = data.pop("rope_parameters")
    data["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    data["rope_scaling"] = params
    file.write_text(json.dumps(data))


# name -> (config class, its kwargs, family we read it as, post-save rewrite)
SUPPORTED: dict[str, tuple[str, dict[str, Any], str, Callable[[Path], None] | None]] = {
    "qwen3": ("Qwen3Config", {}, "qwen3", None),
    "qwen3-tied": ("Qwen3Config", {"tie_word_embeddings": True}, "qwen3", None),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        "qwen3_moe",
        None,
    ),
    "qwen3-yarn": (
        "Qwen3Config",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        },
        "qwen3",
        None,
    ),
    "qwen3-legacy-linear": (
        "Qwen3Config",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
        "qwen3",
        _legacy_rope,
    ),
    "qwen2.5": ("Qwen2Config", {"tie_word_embeddings": True}, "qwen2", None),
    "llama3.1": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            }
        },
        "llama",
        None,
    ),
    "llama": ("LlamaConfig", {}, "llama", None),
    "mistral": ("MistralConfig", {"sliding_window": 8}, "mistral", None),
    # MLA + DeepSeek-style MoE: a dense first layer, then 8 routed experts in 2 groups
    "deepseek-v3": (
        "DeepseekV3Config",
        HF_MLA | {"n_group": 2, "topk_group": 1},
        "deepseek_v3",
        None,
    ),
    "deepseek-v3-yarn-no-q-lora": (
        "DeepseekV3Config",
        HF_MLA
        | {
            "q_lora_rank": None,
            "n_group": 4,
            "topk_group": 2,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "rope_theta": 10000.0,
            },
        },
        "deepseek_v3",
        None,
    ),
    "glm-4.7-flash": ("Glm4MoeLiteConfig", HF_MLA, "glm4_moe_lite", None),
}

# name -> (config class, kwargs, architecture, words the refusal must hold)
REFUSED: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "gemma2": ("Gemma2Config", {}, "Gemma2ForCausalLM", "soft-capping"),
    "deepseek-v2": (
        "DeepseekV2Config",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16},
        "DeepseekV2ForCausalLM",
        "DeepSeek-V2",
    ),
}

_ARCH = {
    "Qwen3Config": "Qwen3ForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "DeepseekV3Config": "DeepseekV3ForCausalLM",
    "Glm4MoeLiteConfig": "Glm4MoeLiteForCausalLM",
}


def write_hf_checkpoint(path: Path, name: str) -> tuple[transformers.PreTrainedModel, str]:
    """A tiny transformers model of case ``name`` saved to ``path`` (fp32, seed 0)."""
    cls_name, extra, _, rewrite = SUPPORTED[name]
    config = hf_config(cls_name, _ARCH[cls_name], **extra)
    torch.manual_seed(0)
    model = getattr(transformers, _ARCH[cls_name])(config).float().eval()
    with torch.no_grad():  # DeepSeek-style routers: a nonzero correction bias steers the choice
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    if rewrite is not None:
        rewrite(path)
    return model, _ARCH[cls_name]


def hf_token_logprobs(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
    picked = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_family_matches_transformers(tmp_path: Path, name: str) -> None:
    hf, arch = write_hf_checkpoint(tmp_path / "hf", name)
    config = load_config(tmp_path / "hf")
    assert config.family == SUPPORTED[name][2]
    model = load_pretrained(tmp_path / "hf")
    ids = torch.randint(0, HF_TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    ref = hf_token_logprobs(hf, ids)
    for numerics in Numerics:
        model.numerics = numerics
        with torch.no_grad():
            ours = model.forward_logprobs(ids, [ids.shape[0]])
        diff = float((ours - ref).abs().max())
        assert diff < TOLERANCE, (name, numerics, diff)
    # strict training forward == KV-cache decode, bit for bit (two sequences, batched decode)
    model.numerics = Numerics.STRICT
    segments = [ids[:30].tolist(), ids[5:40].tolist()]
    train = packed_logprobs(model, segments)
    served = decoded_logprobs(model, segments, [7, 12], chunked_prefill=True)
    assert torch.equal(train, served), name
    # what we save is the family's own layout: transformers loads it, every tensor used
    model.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == [arch]
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32, output_loading_info=True
    )
    assert type(back).__name__ == arch
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert torch.equal(hf_token_logprobs(back, ids), ref)
    assert load_config(tmp_path / "ours") == config


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_every_family_shares_a_prompt_with_the_same_bits(tmp_path: Path, name: str) -> None:
    """``forward_logits(..., shared_prefixes=)`` (a GRPO group's samples sharing their prompt)
    gives each token the strict bits it gets with its segment packed whole, on every family
    (MLA's attention included)."""
    write_hf_checkpoint(tmp_path / "hf", name)
    model = load_pretrained(tmp_path / "hf")
    assert model.takes_shared_prefixes()
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, HF_TINY["vocab_size"], (13,), generator=gen).tolist()
    answers = [torch.randint(0, HF_TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in (3, 1, 5)]  # fmt: skip
    whole = [prompt + a for a in answers]
    with torch.no_grad():
        full = model.forward_logits(
            torch.tensor([t for s in whole for t in s]), [len(s) for s in whole]
        )
        shared = model.forward_logits(
            torch.tensor(whole[0] + answers[1] + answers[2]),
            [len(whole[0]), len(answers[1]), len(answers[2])],
            shared_prefixes=[(-1, 0), (0, 13), (0, 13)],
        )
    rows = [*range(16), *range(16 + 13, 16 + 14), *range(16 + 14 + 13, 16 + 14 + 18)]
    assert torch.equal(shared, full[rows]), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_family_is_refused_by_name(tmp_path: Path, name: str) -> None:
    cls_name, extra, arch, feature = REFUSED[name]
    config = hf_config(cls_name, arch, **extra)
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ModelConfigError, match=arch) as err:
        load_config(tmp_path)
    assert feature in str(err.value)


def test_features_not_computed_exactly_are_refused(tmp_path: Path) -> None:
    base = ModelConfig.tiny(num_experts=0, mlp_only_layers=(), family="qwen3").to_hf_dict()
    cases = [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ]
    for change, words in cases:
        with pytest.raises(ModelConfigError, match="Qwen3ForCausalLM") as err:
            ModelConfig.from_hf_dict(base | change)
        assert words in str(err.value), (change, err.value)
    llama = base | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ModelConfigError, match=r"LlamaForCausalLM.*mlp_bias"):
        ModelConfig.from_hf_dict(llama | {"mlp_bias": True})
    with pytest.raises(ModelConfigError, match=r"'FalconForCausalLM'.*not supported"):
        ModelConfig.from_hf_dict(base | {"architectures": ["FalconForCausalLM"]})


def test_kv_capacity_is_its_own_setting() -> None:
    cfg = ModelConfig.tiny(num_experts=0, mlp_only_layers=(), max_position_embeddings=40960)
    assert cfg.capacity == 40960
    small = cfg.replace(kv_capacity=128)
    assert small.capacity == 128
    assert small.to_hf_dict() == cfg.to_hf_dict()  # not part of config.json
    with pytest.raises(ModelConfigError, match="kv_capacity"):
        cfg.replace(kv_capacity=0)


def test_hub_id_is_read_from_the_local_cache_only(tmp_path: Path) -> None:
    from posttrain.models import CheckpointError, resolve_model_dir

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    cfg = ModelConfig.tiny(num_experts=0, mlp_only_layers=(), family="llama", qk_norm=False)
    (snap / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert resolve_model_dir("acme/tiny-llama", cache_dir=cache) == snap
    with pytest.raises(CheckpointError, match="hf download acme/absent"):
        resolve_model_dir("acme/absent", cache_dir=cache)
    with pytest.raises(CheckpointError, match="neither a local directory nor a hub id"):
        resolve_model_dir(str(tmp_path / "missing"), cache_dir=cache)
