"""The live path quantizes exactly like the converter, with the checkpoint's exclusions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import posttrain.quant_convert as qc
from posttrain.quant_convert import (
    CheckpointError,
    ConvertOptions,
    QuantPolicy,
    convert_checkpoint,
    quantize_named_params,
)
from posttrain.quant_convert.testing import SyntheticSpec, write_synthetic_checkpoint


def _load(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118
                out[k] = h.get_tensor(k)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_live_equals_converter_with_read_back_exclusions(tmp_path: Path) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", SyntheticSpec(layers=3, experts=2, shards=2))
    policy = QuantPolicy(num_layers_at_start_in_bf16=1)
    convert_checkpoint(src, tmp_path / "dst", options=ConvertOptions(policy=policy))
    served = _load(tmp_path / "dst")
    ignore = json.loads((tmp_path / "dst" / "config.json").read_text())["quantization_config"][
        "ignore"
    ]
    source = _load(src)
    # a trainer knows nothing of the BF16 layer range: the read-back exclusions carry it
    out = dict(quantize_named_params(source.items(), num_layers=3, exclude_modules=ignore))
    assert set(out) == {k for k in served if not k.endswith("input_scale")}
    for k, t in out.items():
        assert t.dtype == served[k].dtype, k
        assert torch.equal(_bytes(t), _bytes(served[k])), k
    same = dict(quantize_named_params(source.items(), num_layers=3, policy=policy))
    assert all(torch.equal(_bytes(same[k]), _bytes(out[k])) for k in out)
    # with the served checkpoint's input_scales read back: every tensor it holds, bit for bit
    scales = qc.read_input_scales(tmp_path / "dst")
    assert scales
    assert set(scales) == {k for k in served if k.endswith(".input_scale")}
    full = dict(
        quantize_named_params(
            source.items(), num_layers=3, exclude_modules=ignore, input_scales=scales
        )
    )
    assert set(full) == set(served)
    for k, t in full.items():
        assert (t.dtype, t.shape) == (served[k].dtype, served[k].shape), k
        assert torch.equal(_bytes(t), _bytes(served[k])), k
    bad = {k: torch.ones(3) for k in scales}
    with pytest.raises(CheckpointError, match=r"input_scale: the served checkpoint's has shape"):
        quantize_named_params(source.items(), num_layers=3, input_scales=bad)


def test_live_raises_on_split_pair_and_honours_keep_patterns() -> None:
    g = torch.Generator().manual_seed(0)
    w = {
        f"model.layers.{i}.mlp.experts.0.{p}.weight": torch.randn(16, 32, generator=g).to(
            torch.bfloat16
        )
        for i in range(3)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    bucket = [(k, v) for k, v in w.items() if "layers.0." in k and "up_proj" not in k]
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.0\.gate_proj"):
        quantize_named_params(bucket, num_layers=3)
    policy = QuantPolicy(num_layers_at_end_in_bf16=1, keep_patterns=("layers.1.mlp",))
    out = dict(quantize_named_params(w.items(), num_layers=3, policy=policy))
    assert out["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.uint8
    assert out["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert out["model.layers.2.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert not any(k.endswith("input_scale") for k in out)
    s_g = out["model.layers.0.mlp.experts.0.gate_proj.weight_scale_2"]
    assert torch.equal(s_g, out["model.layers.0.mlp.experts.0.up_proj.weight_scale_2"])


def test_public_surface_is_exactly_all() -> None:
    public = {
        n
        for n, v in vars(qc).items()
        if not n.startswith("_") and getattr(v, "__module__", "").startswith("posttrain.")
    }
    assert public == set(qc.__all__)
