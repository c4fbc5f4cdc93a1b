"""Weight updates (HTTP safetensors, shared memory, disk), LoRA adapters and NVFP4 checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from posttrain.formats import (
    E2M1_VALUES,
    EngineClient,
    adapter_push_body,
    push_distributed,
    tensors_sha256,
)
from posttrain.interface import EngineError
from posttrain.interface.testing import AppServer
from posttrain.local_engine import EngineConfig, build_app
from posttrain.models import LoraAdapter as ModelLora
from posttrain.models import ModelConfig, build_model, build_tokenizer

TINY = {"torch_dtype": "bfloat16", "max_position_embeddings": 48}
PROMPT = [5, 17, 33, 9, 71]


def _generate(c: Any, lora: str | None = None, seed: int = 5) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "sampling_seed": seed, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        body["lora_path"] = lora
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _assert_parity(out: dict[str, Any], model: Any, trainer_lp: Any, lora: Any = None) -> None:
    meta = out["meta_info"]
    ids = PROMPT + out["output_ids"]
    got = [e[0] for e in meta["input_token_logprobs"][1:]] + [
        e[0] for e in meta["output_token_logprobs"]
    ]
    assert got == trainer_lp(model, ids, lora)[1:]


def test_update_from_disk(engine, tmp_path, trainer_lp) -> None:  # type: ignore[no-untyped-def]
    target = build_model(ModelConfig.tiny(**TINY), seed=2)
    target.save_pretrained(tmp_path / "v2")
    with engine() as c:
        r = c.post(
            "/update_weights_from_disk",
            # SGLang's request carries the version as a string; the engine reports the int.
            json={"model_path": str(tmp_path / "v2"), "weight_version": "3"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["weight_version"] == 3
        out = _generate(c)
        assert out["meta_info"]["weight_version"] == 3
        r = c.post(
            "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "v2"), "weight_version": "v4"},
        )
        assert r.status_code == 400
        assert r.json()["error"]["field"] == "weight_version"
        _assert_parity(out, target, trainer_lp)
        sha = c.get("/weights_checksum").json()["sha256"]
        bad = c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
        assert bad.status_code == 400
        # refused before anything changed: the engine keeps serving version 3 (issue #18)
        assert _generate(c)["meta_info"]["weight_version"] == 3
        assert c.get("/weights_checksum").json()["sha256"] == sha


def _adapter_tensors(reference: Any, r: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for module, (d_in, d_out) in reference.lora_targets().items():
        if module.endswith(("q_proj", "v_proj", "down_proj")):
            out[f"base_model.model.{module}.lora_A.weight"] = (
                torch.randn(r, d_in, generator=gen) * 0.3
            )
            out[f"base_model.model.{module}.lora_B.weight"] = (
                torch.randn(d_out, r, generator=gen) * 0.3
            )
    return out


PEFT_CONFIG = {
    "peft_type": "LORA",
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
    "lora_dropout": 0.0,
    "bias": "none",
    "task_type": "CAUSAL_LM",
}


def _model_lora(tensors: dict[str, torch.Tensor], scaling: float) -> ModelLora:
    return ModelLora.from_peft_state_dict(tensors, scaling=scaling)


def _quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain NVFP4 quantizer for the test (nearest E2M1 code per element, amax/6 scales)."""
    w = w.detach().float()
    n, k = w.shape
    blocks = w.reshape(n, k // 16, 16)
    amax = blocks.abs().amax(-1).clamp_min(1e-8)
    scale_2 = torch.tensor(float(amax.max()) / (6 * 448))
    scales = (amax / 6 / scale_2).clamp(max=448).to(torch.float8_e4m3fn)
    step = (scales.float() * scale_2).unsqueeze(-1)
    grid = torch.tensor(E2M1_VALUES)
    codes = (blocks / step).unsqueeze(-1).sub(grid).abs().argmin(-1).reshape(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, scales, scale_2


def _nvfp4_checkpoint(
    reference: Any, tmp_path: Path
) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An NVFP4 checkpoint of ``reference`` (every 2-D projection quantized): its directory,
    its tensors and the dequantized values an engine serves."""
    src = {k: v.detach() for k, v in reference.hf_state_dict().items()}
    quantized: dict[str, torch.Tensor] = {}
    dequantized = dict(src)
    for name, w in src.items():
        if w.dim() == 2 and name.endswith("proj.weight") and w.shape[1] % 16 == 0:
            packed, scales, s2 = _quantize_nvfp4(w)
            prefix = name.removesuffix(".weight")
            quantized |= {
                name: packed,
                f"{prefix}.weight_scale": scales,
                f"{prefix}.weight_scale_2": s2,
                f"{prefix}.input_scale": torch.tensor(1.0),
            }
            codes = torch.stack([packed & 15, packed >> 4], -1).reshape(w.shape).long()
            value = torch.tensor(E2M1_VALUES)[codes].reshape(w.shape[0], -1, 16) * (
                scales.float() * s2
            ).unsqueeze(-1)
            dequantized[name] = value.reshape(w.shape).to(w.dtype)
        else:
            quantized[name] = w
    d = tmp_path / "nvfp4"
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(d / "model.safetensors"))
    cfg = reference.config.to_hf_dict() | {
        "quantization_config": {"quant_algo": "NVFP4", "quant_method": "modelopt", "group_size": 16,
                                "ignore": ["lm_head"]}
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    build_tokenizer().save_pretrained(str(d))
    return d, quantized, dequantized


def test_nvfp4_checkpoint_loads_dequantized_and_is_reported(
    engine, reference, tmp_path, trainer_lp
) -> None:  # type: ignore[no-untyped-def]
    d, quantized, dequantized = _nvfp4_checkpoint(reference, tmp_path)
    with engine(model_path=d) as c:
        info = c.get("/server_info").json()
        assert info["quantization"] == "modelopt_fp4"
        report = info["quantization_report"]
        n_quantized = sum(1 for k in quantized if k.endswith("_scale_2"))
        assert n_quantized > 10
        assert report["dequantized_tensors"] == n_quantized
        assert c.get("/weights_checksum").json()["sha256"] == tensors_sha256(dequantized)
        out = _generate(c)
    target = build_model(reference.config, seed=0)
    target.load_hf_state_dict(dequantized)
    _assert_parity(out, target, trainer_lp)
    assert Path(d / "tokenizer.json").exists()


def test_lora_by_path_and_from_tensors_in_sglangs_body(
    engine, reference, trainer_lp, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    t1 = _adapter_tensors(reference, 4, seed=1)
    peft_dir = tmp_path / "adapter"
    peft_dir.mkdir()
    (peft_dir / "adapter_config.json").write_text(json.dumps(PEFT_CONFIG))
    save_file(t1, str(peft_dir / "adapter_model.safetensors"))
    t2 = _adapter_tensors(reference, 4, seed=2)
    with engine(enable_lora=True, lora_paths={"boot": str(peft_dir)}) as c:
        base_sha = c.get("/weights_checksum").json()["sha256"]
        _assert_parity(_generate(c, "boot"), reference, trainer_lp, _model_lora(t1, 2.0))
        # by path, under another name
        r = c.post("/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(peft_dir)})
        assert r.status_code == 200
        assert set(r.json()["loaded_adapters"]) == {"boot", "a1"}
        # from tensors sent in the request (SGLang's serialized_named_tensors)
        body = adapter_push_body("a2", PEFT_CONFIG, t2).to_dict()
        assert c.post("/load_lora_adapter_from_tensors", json=body).status_code == 200
        out2 = _generate(c, "a2")
        _assert_parity(out2, reference, trainer_lp, _model_lora(t2, 2.0))
        # no adapter = base model
        _assert_parity(_generate(c), reference, trainer_lp)
        # again under the same name, two TP-rank copies: replaces a2 atomically
        t3 = _adapter_tensors(reference, 4, seed=3)
        body = adapter_push_body("a2", PEFT_CONFIG, t3, tp_size=2).to_dict()
        assert c.post("/load_lora_adapter_from_tensors", json=body).status_code == 200
        _assert_parity(_generate(c, "a2"), reference, trainer_lp, _model_lora(t3, 2.0))
        assert c.get("/weights_checksum").json()["sha256"] == base_sha  # base untouched
        # unload, then the name is unknown (400)
        assert c.post("/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
        r = c.post("/generate", json={"input_ids": PROMPT, "lora_path": "a1"})
        assert r.status_code == 400
        assert "a1" in r.json()["error"]["message"]
        # malformed adapters are refused, naming the tensor
        bad = dict(t2)
        bad.pop(next(k for k in bad if k.endswith("lora_B.weight")))
        body = adapter_push_body("bad", PEFT_CONFIG, bad).to_dict()
        r = c.post("/load_lora_adapter_from_tensors", json=body)
        assert r.status_code == 400
        assert "without its pair" in r.json()["error"]["message"]
        r = c.post(
            "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")}
        )
        assert r.status_code == 400


def test_nvfp4_engine_takes_packed_updates_as_sglang_does(reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Served from an NVFP4 checkpoint, the engine takes updates in the checkpoint's own NVFP4
    tensors (SGLang's modelopt_fp4 names and dtypes) and serves them dequantized; an update
    that leaves out a part of a group is refused and the old weights keep serving."""
    d, quantized, _ = _nvfp4_checkpoint(reference, tmp_path / "a")
    _, moved, moved_values = _nvfp4_checkpoint(
        build_model(reference.config, seed=5), tmp_path / "b"
    )
    with AppServer(build_app(EngineConfig(model_path=str(d))), timeout_s=60) as s:
        before = httpx.get(f"{s.url}/weights_checksum").json()
        broken = {k: v for k, v in moved.items() if not k.endswith("q_proj.weight_scale_2")}
        with EngineClient(s.url) as client, pytest.raises(EngineError, match="weight_scale_2"):
            push_distributed([client], list(broken.items()), weight_version=1, timeout_s=60)
        assert httpx.get(f"{s.url}/weights_checksum").json() == before
        with EngineClient(s.url) as client:
            push_distributed([client], list(moved.items()), weight_version=1, timeout_s=60)
        after = httpx.get(f"{s.url}/weights_checksum").json()
    assert after["weight_version"] == 1
    assert after["sha256"] == tensors_sha256(moved_values)
    assert set(quantized) == set(moved)
