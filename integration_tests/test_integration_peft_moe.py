"""MoE adapters against real PEFT on transformers 5: both conventions, every target applied.

A tiny Dense/MoE ``posttrain.models`` checkpoint (layer 0 dense, the rest MoE) is loaded by
transformers (stacked experts: ``mlp.experts.gate_up_proj`` / ``down_proj``). ``attach_lora``
adapts attention, the dense MLP and the stacked experts; the adapter is exported in PEFT's
``target_parameters`` form and loaded with ``PeftModel.from_pretrained``: logits equal ours
(<= 1e-5 fp32), and with all factors but one target's zeroed, PEFT's output still moves off
the base model (the target is applied, not dropped). The per-expert form (SGLang, transformers
4; see docs/benchmarks/lora-core.md for the transformers 4.57 run) round-trips through ours, and
on transformers 5 PEFT drops the dense MLP from it, the behaviour the other form exists for.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.formats import read_peft_adapter
from posttrain.lora import (
    LoraConfig,
    LoraConfigError,
    attach_lora,
    export_adapter,
    load_peft,
    save_peft,
)
from posttrain.lora.stacked import LoraStackedExperts
from posttrain.models import ModelConfig, build_model, save_pretrained

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CFG = LoraConfig(r=2, alpha=4.0, b_init="normal", seed=5, export_dtype=torch.float32)
IDS = torch.tensor([[1, 5, 9, 3, 17, 42, 8, 2, 11, 60]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig.tiny(num_hidden_layers=2, torch_dtype="float32")
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(build_model(config, seed=0), path)
    return path


def hf_model(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert model.model.layers[0].mlp.__class__.__name__.endswith("MLP")  # layer 0 is dense
    assert model.model.layers[1].mlp.experts.gate_up_proj.ndim == 3  # stacked experts
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=IDS).logits.float()
    return out


def ours_with_adapter(path: Path) -> tuple[torch.nn.Module, object]:
    model = hf_model(path)
    handle = attach_lora(model, CFG, TARGETS)
    with torch.no_grad():  # a non-zero A and B everywhere (B starts at zero in real training)
        for site in handle.sites.values():
            site.lora_B.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    return model, handle


def test_attach_targets_stacked_experts_by_suffix(checkpoint: Path) -> None:
    model, handle = ours_with_adapter(checkpoint)
    stacked = {p for p, s in handle.sites.items() if isinstance(s, LoraStackedExperts)}
    assert stacked == {
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.experts.down_proj",
    }
    assert "model.layers.0.mlp.gate_proj" in handle.sites  # the dense layer's nn.Linear
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    assert all(".lora_" in n for n in trainable)
    out = model(input_ids=IDS).logits.float().square().mean()
    out.backward()
    site = handle.sites["model.layers.1.mlp.experts.gate_up_proj"]
    assert site.lora_A.grad is not None
    assert site.lora_A.grad.abs().sum() > 0
    with pytest.raises(LoraConfigError, match="both or neither"):
        attach_lora(hf_model(checkpoint), CFG, ["gate_proj"])


@pytest.mark.parametrize("convention", ["per_expert", "target_parameters"])
def test_export_import_round_trip_in_both_conventions(
    checkpoint: Path, tmp_path: Path, convention: str
) -> None:
    model, handle = ours_with_adapter(checkpoint)
    adapter = export_adapter(handle)
    assert "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight" in adapter
    save_peft(tmp_path / "a", adapter, CFG, moe_convention=convention)  # type: ignore[arg-type]
    saved = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    if convention == "target_parameters":
        assert not {"gate_proj", "up_proj", "down_proj"} & set(saved["target_modules"])
        assert {"experts.gate_up_proj", "experts.down_proj", "gate_proj.weight"} <= set(
            saved["target_parameters"]
        )
    assert read_peft_adapter(tmp_path / "a").convention == convention
    other, other_handle = ours_with_adapter(checkpoint)
    with torch.no_grad():
        for p in other_handle.parameters():
            p.zero_()
    loaded = load_peft(other_handle, tmp_path / "a")
    assert len(loaded) == len(adapter)
    for key, value in export_adapter(other_handle).items():
        assert torch.equal(value, adapter[key]), key
    assert (logits(model) - logits(other)).abs().max() == 0


def _peft_logits(checkpoint: Path, directory: Path) -> torch.Tensor:
    pm = peft.PeftModel.from_pretrained(hf_model(checkpoint), str(directory)).eval()
    return logits(pm)


def test_target_parameters_adapter_applies_every_target_in_peft(
    checkpoint: Path, tmp_path: Path
) -> None:
    base = logits(hf_model(checkpoint))
    model, handle = ours_with_adapter(checkpoint)
    full = export_adapter(handle)
    save_peft(tmp_path / "all", full, CFG, moe_convention="target_parameters")
    ours = logits(model)
    assert (ours - base).abs().max() > 1e-3
    assert (_peft_logits(checkpoint, tmp_path / "all") - ours).abs().max() <= 1e-5
    # one target kind at a time: all other factors zero
    kinds = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "experts.0.gate_proj",
        "experts.2.up_proj",
        "experts.1.down_proj",
    ]
    for kind in kinds:
        only = {k: (v if f".{kind}.lora_" in k else torch.zeros_like(v)) for k, v in full.items()}
        assert any(v.abs().sum() > 0 for v in only.values()), kind
        with torch.no_grad():
            load_peft(handle, _save(tmp_path / kind, only, "per_expert"))
        ours_one = logits(model)
        assert (ours_one - base).abs().max() > 1e-4, kind
        got = _peft_logits(checkpoint, _save(tmp_path / f"{kind}-tp", only, "target_parameters"))
        assert (got - base).abs().max() > 1e-4, f"PEFT ignored {kind}"
        assert (got - ours_one).abs().max() <= 1e-5, kind


def _save(path: Path, tensors: dict[str, torch.Tensor], convention: str) -> Path:
    return save_peft(path, tensors, CFG, moe_convention=convention)  # type: ignore[arg-type]


def test_per_expert_adapter_loses_dense_mlp_in_peft_on_transformers5(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Documents PEFT 0.21's config rewrite (why the target_parameters form exists)."""
    base = logits(hf_model(checkpoint))
    _, handle = ours_with_adapter(checkpoint)
    full = export_adapter(handle)
    only = {
        k: (v if ".layers.0.mlp.down_proj.lora_" in k else torch.zeros_like(v))
        for k, v in full.items()
    }
    got = _peft_logits(checkpoint, _save(tmp_path / "pe", only, "per_expert"))
    assert (got - base).abs().max() == 0


def test_rslora_scale_survives_the_fused_gate_up_rank(checkpoint: Path, tmp_path: Path) -> None:
    """gate+up become one rank-2r adapter: alpha_pattern must keep alpha/sqrt(r), not /sqrt(2r)."""
    cfg = LoraConfig(
        r=2, alpha=4.0, b_init="normal", seed=5, export_dtype=torch.float32, use_rslora=True
    )
    model = hf_model(checkpoint)
    handle = attach_lora(model, cfg, ["gate_proj", "up_proj"])
    with torch.no_grad():
        for site in handle.sites.values():
            site.lora_B.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    path = save_peft(
        tmp_path / "rs", export_adapter(handle), cfg, moe_convention="target_parameters"
    )
    saved = json.loads((path / "adapter_config.json").read_text())
    assert saved["alpha_pattern"] == {r".*\.gate_up_proj": pytest.approx(4.0 * 2**0.5)}
    assert (_peft_logits(checkpoint, path) - logits(model)).abs().max() <= 1e-5
