"""PEFT round trip with the real ``peft`` package on a tiny Llama built from a config.

Our exported adapter loads with ``PeftModel.from_pretrained`` and gives the same logits; a
PEFT-saved adapter loads into ours; strict loading rejects missing, unknown and mis-shaped keys
(PEFT itself only warns); merging gives the adapter's logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.formats import PeftFormatError, read_peft_adapter, write_peft_adapter
from posttrain.interface import LoraSpec
from posttrain.lora import (
    AdapterFormatError,
    LoraConfig,
    attach_lora,
    export_adapter,
    load_peft,
    merge_into_base,
    save_peft,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CFG = LoraConfig(r=4, alpha=8.0, b_init="normal", seed=3, export_dtype=torch.float32)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).eval()


IDS = torch.tensor([[1, 5, 9, 3, 17, 42, 8, 2]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def test_exported_adapter_loads_in_peft_with_same_logits(tmp_path: Path) -> None:
    base = tiny_llama()
    ours = copy.deepcopy(base)
    handle = attach_lora(ours, CFG, TARGETS)
    adapter = export_adapter(handle)
    assert len(adapter) == 2 * 7 * 2
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in adapter
    save_peft(tmp_path / "a", adapter, CFG)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(TARGETS)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "a")).eval()
    ours_logits, peft_logits = logits(ours), logits(pm)
    assert (ours_logits - logits(base)).abs().max() > 1e-3  # the adapter does something
    assert (ours_logits - peft_logits).abs().max() <= 1e-5


def test_peft_saved_adapter_loads_into_ours(tmp_path: Path) -> None:
    base = tiny_llama()
    torch.manual_seed(1)
    pcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(base), pcfg).eval()
    pm.save_pretrained(str(tmp_path / "p"))
    ours = copy.deepcopy(base)
    handle = attach_lora(ours, LoraConfig(r=4, alpha=8.0), TARGETS)
    loaded = load_peft(handle, tmp_path / "p")
    assert len(loaded) == 28
    assert (logits(ours) - logits(pm)).abs().max() <= 1e-5


def test_strict_load_rejects_missing_unknown_and_misshaped(tmp_path: Path) -> None:
    base = tiny_llama()
    handle = attach_lora(copy.deepcopy(base), CFG, TARGETS)
    adapter = export_adapter(handle)
    save_peft(tmp_path / "good", adapter, CFG)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def variant(name: str, tensors: dict[str, torch.Tensor]) -> Path:
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(
            (tmp_path / "good" / "adapter_config.json").read_text()
        )
        return d

    pair = (key, key.replace("lora_A", "lora_B"))
    missing = variant("missing", {k: v for k, v in adapter.items() if k not in pair})
    with pytest.raises(AdapterFormatError, match="missing"):
        load_peft(handle, missing)
    assert load_peft(handle, missing, strict=False)  # non-strict keeps the other sites
    extra = "base_model.model.model.layers.7.self_attn.q_proj"  # no layer 7 in this model
    unknown = variant(
        "unknown",
        {
            **adapter,
            f"{extra}.lora_A.weight": torch.zeros(4, 16),
            f"{extra}.lora_B.weight": torch.zeros(16, 4),
        },
    )
    with pytest.raises(AdapterFormatError, match=r"unknown .*layers\.7"):
        load_peft(handle, unknown)
    bad = variant("bad", {**adapter, key: torch.zeros(4, 15)})
    with pytest.raises(AdapterFormatError, match=r"q_proj.lora_A.weight has shape \(4, 15\)"):
        load_peft(handle, bad, strict=False)
    wrong_r = tmp_path / "wrong_r"
    r8 = LoraConfig(r=8, alpha=8.0)
    save_peft(wrong_r, export_adapter(attach_lora(copy.deepcopy(base), r8, TARGETS)), r8)
    with pytest.raises(AdapterFormatError, match="r=8"):
        load_peft(handle, wrong_r)
    with pytest.raises(AdapterFormatError, match=r"has rank 4 .* says r=8"):
        save_peft(tmp_path / "never", adapter, r8)  # refused before anything is written
    assert not (tmp_path / "never").exists()


def test_merge_into_base_matches_adapter_logits() -> None:
    model = tiny_llama()
    handle = attach_lora(model, CFG, TARGETS)
    with_adapter = logits(model)
    merge_into_base(handle)
    merged = logits(model)
    rel = (merged - with_adapter).norm() / with_adapter.norm()
    assert rel <= 1e-6


def test_save_peft_is_atomic_and_replaces(tmp_path: Path) -> None:
    handle = attach_lora(tiny_llama(), CFG, TARGETS)
    adapter = export_adapter(handle)
    target = tmp_path / "out"
    save_peft(target, adapter, CFG)
    first = load_file(str(target / "adapter_model.safetensors"))
    doubled = {k: v * 2 for k, v in adapter.items()}
    save_peft(target, doubled, CFG)
    second = load_file(str(target / "adapter_model.safetensors"))
    assert all(torch.equal(second[k], first[k] * 2) for k in first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or backup left
    with pytest.raises(AdapterFormatError, match="not a PEFT LoRA key"):
        save_peft(tmp_path / "x", {"model.w": torch.zeros(1)}, CFG)
    assert not (tmp_path / "x").exists()


# ---- issue #18.7: load_peft refuses what it used to load silently or crash on ----------------


def _hostile(adapter: dict[str, torch.Tensor], case: str) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter after one hostile edit, and the config text to write beside it."""
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    config = json.dumps(CFG.peft_config(sorted(TARGETS)))
    edits: dict[str, torch.Tensor] = {
        "int64": adapter[key].to(torch.int64),
        "bool": adapter[key] > 0,
        "nan": adapter[key].masked_fill(torch.ones_like(adapter[key], dtype=torch.bool), torch.nan),
        "inf": adapter[key].masked_fill(torch.ones_like(adapter[key], dtype=torch.bool), torch.inf),
    }
    if case in edits:
        return {**adapter, key: edits[case]}, config
    if case == "targets":
        return adapter, json.dumps(CFG.peft_config(["q_proj", "k_proj"]))
    if case == "list":
        return adapter, "[" + config + "]"  # a JSON list, not an object
    return adapter, config  # "corrupt": the file is cut afterwards


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("int64", "q_proj.lora_A.weight has dtype int64"),
        ("bool", "q_proj.lora_A.weight has dtype bool"),
        ("nan", "q_proj.lora_A.weight contains NaN"),
        ("inf", "q_proj.lora_A.weight contains Inf"),
        ("targets", r"target_modules \['q_proj', 'k_proj'\] do not select"),
        ("list", "a JSON list, not an object"),
        ("corrupt", "not a readable safetensors file"),
    ],
)
def test_load_peft_refuses_hostile_adapters(tmp_path: Path, case: str, match: str) -> None:
    handle = attach_lora(tiny_llama(), CFG, TARGETS)
    tensors, config = _hostile(export_adapter(handle), case)
    d = tmp_path / case
    d.mkdir()
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(config)
    if case == "corrupt":
        blob = (d / "adapter_model.safetensors").read_bytes()
        (d / "adapter_model.safetensors").write_bytes(blob[: len(blob) // 3])
    with pytest.raises(AdapterFormatError, match=match) as info:
        load_peft(handle, d)
    assert isinstance(info.value, PeftFormatError)  # one error, in both trees
    assert str(d) in str(info.value)


def test_formats_writer_output_loads_in_peft(tmp_path: Path) -> None:
    """An adapter written by posttrain.formats alone (bf16, ``all-linear``) loads in real PEFT
    with our logits, and PEFT's own save reads back through posttrain.formats."""
    base = tiny_llama()
    ours = copy.deepcopy(base)
    handle = attach_lora(ours, CFG, TARGETS)
    spec = LoraSpec(r=CFG.r, alpha=CFG.alpha, target_modules=("all-linear",))
    write_peft_adapter(tmp_path / "f", export_adapter(handle), spec, dtype=torch.bfloat16)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "f")).eval()
    assert {m.rsplit(".", 1)[-1] for m in pm.peft_config["default"].target_modules} == set(TARGETS)
    assert (logits(ours) - logits(pm)).abs().max() <= 2e-2  # factors rounded to bf16
    pm.save_pretrained(str(tmp_path / "p"))
    back = read_peft_adapter(tmp_path / "p")
    assert (back.spec.r, back.spec.alpha) == (CFG.r, CFG.alpha)
    assert back.tensors.keys() == export_adapter(handle).keys()
