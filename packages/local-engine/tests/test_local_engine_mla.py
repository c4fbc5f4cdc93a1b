"""A GLM-4.7-Flash-layout checkpoint (MLA + DeepSeek-style MoE) served in process: the engine
decodes through the MLA cache (compressed latent + rope key) and returns exactly the
trainer's packed-forward logprobs, without and with a LoRA adapter on every MLA projection
(``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``) and the
dense layer's MLP.

The checkpoint is written by transformers' own ``Glm4MoeLiteForCausalLM`` (random init, a
nonzero routing correction bias), then loaded and saved by ``posttrain.models`` with the
local tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from starlette.testclient import TestClient

from posttrain.local_engine import EngineConfig, build_app
from posttrain.models import LoraAdapter, build_tokenizer, load_pretrained
from posttrain.models.testing import HF_MLA, hf_config

_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj")
_PEFT = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": list(_TARGETS),
         "lora_dropout": 0.0, "bias": "none"}  # fmt: skip


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("glm")
    config = hf_config("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", **HF_MLA, vocab_size=128)
    torch.manual_seed(0)
    hf = transformers.Glm4MoeLiteForCausalLM(config).float()
    with torch.no_grad():
        for module in hf.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.1)
    hf.save_pretrained(str(root / "hf"))
    load_pretrained(root / "hf").save_pretrained(root / "ours", tokenizer=build_tokenizer())
    return root / "ours"


def _adapter(targets: dict[str, tuple[int, int]], root: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out: dict[str, torch.Tensor] = {}
    for module, (d_in, d_out) in sorted(targets.items()):
        if module.endswith(_TARGETS):
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(2, d_in, generator=gen)
            out[f"base_model.model.{module}.lora_B.weight"] = (
                torch.randn(d_out, 2, generator=gen) * 0.3
            )
    root.mkdir()
    (root / "adapter_config.json").write_text(json.dumps(_PEFT))
    save_file(out, str(root / "adapter_model.safetensors"))
    return out


def test_engine_logprobs_equal_the_trainer_with_and_without_adapter(
    glm_dir: Path, tmp_path: Path
) -> None:
    trainer = load_pretrained(glm_dir)
    assert trainer.config.family == "glm4_moe_lite"
    assert trainer.config.is_mla
    tensors = _adapter(trainer.lora_targets(), tmp_path / "adapter")
    names = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors}
    assert names == set(_TARGETS)  # every MLA projection that exists, and the dense MLP
    adapter = LoraAdapter.from_peft_state_dict(tensors, scaling=2.0)
    prompts = [[1, 40, 41, 42, 43, 44], [1, 60], [1, 70, 71, 72, 73, 74, 75, 76]]
    cfg = EngineConfig(model_path=str(glm_dir), enable_lora=True,
                       lora_paths={"a": str(tmp_path / "adapter")})  # fmt: skip
    with TestClient(build_app(cfg)) as client:
        for lora in (None, "a"):
            body = {"input_ids": prompts, "return_logprob": True, "logprob_start_len": 0,
                    "sampling_params": {"temperature": 1.0, "max_new_tokens": 12,
                                        "ignore_eos": True, "sampling_seed": 3}}  # fmt: skip
            if lora is not None:
                body["lora_path"] = [lora] * len(prompts)
            reply = client.post("/generate", json=body)
            assert reply.status_code == 200, reply.text
            sequences, served = [], []
            for prompt, item in zip(prompts, reply.json(), strict=True):
                meta = item["meta_info"]
                sequences.append(prompt + [int(e[1]) for e in meta["output_token_logprobs"]])
                served += [e[0] for e in meta["input_token_logprobs"]][1:]
                served += [e[0] for e in meta["output_token_logprobs"]]
            ids = torch.tensor([t for s in sequences for t in s])
            with torch.no_grad():
                packed = trainer.forward_logprobs(
                    ids, [len(s) for s in sequences], lora=None if lora is None else adapter
                )
            starts = {sum(len(s) for s in sequences[:j]) for j in range(len(sequences))}
            want = [float(x) for t, x in enumerate(packed.tolist()) if t not in starts]
            assert served == want, lora  # bit for bit, decode against the packed forward
