"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-4.x checkpoints: real safetensors
with ``num_nextn_predict_layers`` extra layers (``model.layers.{num_hidden_layers}.*``: a decoder
layer plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``) load with those layers skipped and
reported once, the model computes exactly what the checkpoint without them computes, and a save
writes only the decoder. Undeclared layers past the decoder stay unknown tensors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.models import (
    VOCAB_SIZE,
    CheckpointError,
    ModelConfig,
    UnknownTensorError,
    build_model,
    load_pretrained,
)

CONFIG = ModelConfig.mla_tiny("deepseek_v3", vocab_size=VOCAB_SIZE, num_hidden_layers=2)
MTP = "model.layers.2."


def with_mtp_layer(src: Path, dst: Path, declared: object) -> Path:
    """``src``'s checkpoint plus one MTP layer (layer 1's tensors renamed, and the MTP
    projections), ``config.json`` declaring ``num_nextn_predict_layers=declared``."""
    tensors = load_file(src / "model.safetensors")
    h = CONFIG.hidden_size
    extra = {
        MTP + "enorm.weight": torch.ones(h),
        MTP + "hnorm.weight": torch.ones(h),
        MTP + "eh_proj.weight": torch.randn(h, 2 * h),
        MTP + "shared_head.norm.weight": torch.ones(h),
        MTP + "shared_head.head.weight": torch.randn(VOCAB_SIZE, h),
        MTP + "embed_tokens.weight": torch.randn(VOCAB_SIZE, h),
    }
    for name, value in tensors.items():
        if name.startswith("model.layers.1."):
            extra[name.replace("model.layers.1.", MTP)] = value + 1.0
    dst.mkdir()
    save_file({**tensors, **extra}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_nextn_predict_layers"] = declared
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mtp") / "plain"
    build_model(CONFIG, seed=2).save_pretrained(path)
    return path


def test_mtp_layers_are_skipped_reported_once_and_not_saved(
    plain: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mtp = with_mtp_layer(plain, tmp_path / "mtp", 1)
    ids = torch.tensor([5, 9, 17, 3, 40, 8])
    with caplog.at_level(logging.WARNING, logger="posttrain.models"):
        model = load_pretrained(mtp)
        load_pretrained(mtp)  # said once per directory
    reports = [r.getMessage() for r in caplog.records if r.name == "posttrain.models"]
    assert len(reports) == 1, reports
    assert "model.layers.2.*" in reports[0]
    assert "num_nextn_predict_layers=1" in reports[0]
    extra = len(load_file(mtp / "model.safetensors")) - len(load_file(plain / "model.safetensors"))
    assert f"the {extra} tensors" in reports[0]
    assert not any(name.startswith(MTP) for name in model.hf_state_dict())
    reference = load_pretrained(plain)
    assert torch.equal(
        model.forward_logprobs(ids, [len(ids)]), reference.forward_logprobs(ids, [len(ids)])
    )
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == load_file(plain / "model.safetensors").keys()
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0  # the written checkpoint has no MTP layer


def test_layers_past_the_decoder_that_the_config_does_not_declare_are_unknown(
    plain: Path, tmp_path: Path
) -> None:
    with pytest.raises(UnknownTensorError, match=r"model\.layers\.2\."):
        load_pretrained(with_mtp_layer(plain, tmp_path / "undeclared", 0))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        load_pretrained(with_mtp_layer(plain, tmp_path / "bad", "1"))
