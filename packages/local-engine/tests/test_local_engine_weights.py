"""Weight updates (HTTP safetensors, shared memory, disk), LoRA adapters and NVFP4 checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save, save_file

from posttrain.formats import (
    E2M1_VALUES,
    ShmRing,
    WeightPushClient,
    encode_bucket_body,
    expected_tensors,
    pack_bucket,
    push_weights,
    tensors_sha256,
)
from posttrain.interface import (
    EngineError,
    IncompleteUpdateError,
    StaleVersionError,
    WeightUpdateBegin,
)
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


def _pusher(c: Any) -> WeightPushClient:
    return WeightPushClient("http://testserver", http=c)


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_update_then_parity_and_checksum(engine, other_weights, trainer_lp, transport) -> None:  # type: ignore[no-untyped-def]
    target = build_model(ModelConfig.tiny(**TINY), seed=1)
    with engine() as c:
        before = _generate(c)
        result = push_weights(
            _pusher(c),
            other_weights,
            weight_version=1,
            transport=transport,
            bucket_bytes=8 * 1024,  # many buckets: the shm ring's two slots are reused
            with_sha256=True,
        )
        assert result.success
        assert result.weight_version == 1
        after = _generate(c)
        assert after["meta_info"]["weight_version"] == 1
        assert c.get("/weights_checksum").json()["sha256"] == tensors_sha256(other_weights)
    assert after["meta_info"]["input_token_logprobs"] != before["meta_info"]["input_token_logprobs"]
    _assert_parity(after, target, trainer_lp)


def _begin(uid: str, version: int, items: Any) -> WeightUpdateBegin:
    return WeightUpdateBegin(
        update_id=uid, weight_version=version, kind="base", expected=expected_tensors(items)
    )


def test_refused_updates_keep_serving_abandoned_ones_leave_engine_unavailable(
    engine, other_weights
) -> None:  # type: ignore[no-untyped-def]
    items = list(other_weights.items())
    with engine() as c:
        p = _pusher(c)
        push_weights(p, other_weights, weight_version=5)
        # stale version: refused at begin, engine keeps serving
        with pytest.raises(StaleVersionError):
            push_weights(p, other_weights, weight_version=5)
        assert c.post("/generate", json={"input_ids": [4, 5]}).status_code == 200
        # unknown tensor in the expected list: refused at begin
        with pytest.raises(EngineError, match="unknown"):
            p.begin(_begin("u1", 6, [("nope", torch.ones(1))]))
        # missing tensor: the end reports it, /generate answers 503
        p.begin(_begin("u2", 6, items))
        p.send_bucket(*pack_bucket(items[:-1], update_id="u2", weight_version=6))
        with pytest.raises(IncompleteUpdateError, match="missing"):
            p.end("u2")
        r = c.post("/generate", json={"input_ids": [4, 5]})
        assert r.status_code == 503
        assert "missing" in r.json()["error"]["message"]
        # a full update brings it back
        assert push_weights(p, other_weights, weight_version=6).success
        # wrong dtype in a bucket: refused with a 400 naming the tensor; the update is over and
        # the engine keeps serving version 6
        name, t = items[0]
        p.begin(_begin("u3", 7, items))
        m, buf = pack_bucket([(name, t.float())], update_id="u3", weight_version=7, is_last=False)
        with pytest.raises(EngineError, match=name):
            p.send_bucket(m, buf)
        assert c.post("/end_weight_update", json={"update_id": "u3"}).status_code == 400
        assert _generate(c)["meta_info"]["weight_version"] == 6
        # duplicate across buckets: refused, still serving
        p.begin(_begin("u4", 7, items))
        p.send_bucket(*pack_bucket([items[0]], update_id="u4", weight_version=7, is_last=False))
        m1, buf1 = pack_bucket([items[0]], update_id="u4", weight_version=7, bucket_index=1)
        with pytest.raises(EngineError, match="twice"):
            p.send_bucket(m1, buf1)
        assert _generate(c)["meta_info"]["weight_version"] == 6
        # aborted midway by the trainer: abandoned, 503 until a full update (wsync/1)
        p.begin(_begin("u5", 7, items))
        p.send_bucket(*pack_bucket(items[:3], update_id="u5", weight_version=7, is_last=False))
        p.abort("u5")
        assert c.post("/generate", json={"input_ids": [4, 5]}).status_code == 503
        assert c.get("/server_info").json()["weights_serviceable"] is False
        # a full update brings it back
        assert push_weights(p, other_weights, weight_version=7, transport="shm").success
        assert c.post("/generate", json={"input_ids": [4, 5]}).status_code == 200
        # a corrupted bucket (sha256 mismatch) over shm
        with ShmRing(1 << 16) as ring:
            p.ring = ring
            p.begin(_begin("u8", 8, items[:1]))
            m, buf = pack_bucket(items[:1], update_id="u8", weight_version=8, out=ring.slot(0))
            ring.slot(0)[0] ^= 0xFF
            with pytest.raises(EngineError, match="sha256"):
                p.send_bucket(m, buf)  # sent from the slot it was packed in
            p.ring = None
        bad = c.post(
            "/update_weights_from_shm",
            json={"manifest": m.to_dict(), "shm_path": "/etc/passwd", "slot": 0},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["field"] in ("shm_path", "update_id")


def test_a_bucket_body_that_fails_to_decode_refuses_its_update(engine, other_weights) -> None:  # type: ignore[no-untyped-def]
    items = list(other_weights.items())
    name, t = items[0]
    with engine() as c:
        p = _pusher(c)
        assert push_weights(p, other_weights, weight_version=1).success
        served = _generate(c)
        m, buf = pack_bucket([(name, t)], update_id="x", weight_version=2, is_last=False)
        tampered = bytearray(encode_bucket_body(m, buf))
        tampered[-1] ^= 1  # parses, but its bytes no longer hash to the manifest's sha256
        m, _ = pack_bucket([(name, t)], update_id="y", weight_version=2, is_last=False)
        disagreeing = save({name: t.float()}, metadata={"manifest": m.to_json()})
        for uid, body, field in (
            ("x", bytes(tampered), "manifest.sha256"),
            ("y", disagreeing, "manifest.tensors[0]"),
        ):
            p.begin(_begin(uid, 2, items))
            r = c.post("/update_weights_from_safetensors", content=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["field"] == field
            # refused, not left open to end as "missing": nothing to end, version 1 serves on
            end = c.post("/end_weight_update", json={"update_id": uid})
            assert end.status_code == 400
            assert "no weight update is open" in end.json()["error"]["message"]
            # the previous weights still serve: same checksum, same tokens and logprobs
            assert c.get("/weights_checksum").json()["sha256"] == tensors_sha256(other_weights)
            out = _generate(c)
            assert out["meta_info"]["weight_version"] == 1
            assert out["output_ids"] == served["output_ids"]
            assert (
                out["meta_info"]["output_token_logprobs"]
                == served["meta_info"]["output_token_logprobs"]
            )
        # a body whose manifest cannot be read names no update: the open one is left alone
        p.begin(_begin("z", 2, items))
        r = c.post("/update_weights_from_safetensors", content=save({name: t}))
        assert r.status_code == 400
        assert r.json()["error"]["field"] == "__metadata__.manifest"
        for k, (n, tensor) in enumerate(items):
            p.send_bucket(
                *pack_bucket(
                    [(n, tensor)], update_id="z", weight_version=2, bucket_index=k,
                    is_last=k == len(items) - 1,
                )
            )  # fmt: skip
        assert p.end("z").success
        assert _generate(c)["meta_info"]["weight_version"] == 2


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


def test_lora_by_path_from_tensors_and_by_session(engine, reference, trainer_lp, tmp_path) -> None:  # type: ignore[no-untyped-def]
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
        # from tensors sent in the request (safetensors bytes)
        body = save(t2, metadata={"lora_name": "a2", "config_dict": json.dumps(PEFT_CONFIG)})
        assert c.post("/load_lora_adapter_from_tensors", content=body).status_code == 200
        out2 = _generate(c, "a2")
        _assert_parity(out2, reference, trainer_lp, _model_lora(t2, 2.0))
        # no adapter = base model
        _assert_parity(_generate(c), reference, trainer_lp)
        # by a wsync session of kind lora, over shm, replacing a2 atomically
        t3 = _adapter_tensors(reference, 4, seed=3)
        res = push_weights(
            _pusher(c), t3, weight_version=1, kind="lora", lora_name="a2",
            lora_config=PEFT_CONFIG, transport="shm",
        )  # fmt: skip
        assert res.success
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
        body = save(bad, metadata={"lora_name": "bad", "config_dict": json.dumps(PEFT_CONFIG)})
        r = c.post("/load_lora_adapter_from_tensors", content=body)
        assert r.status_code == 400
        assert "without its pair" in r.json()["error"]["message"]
        r = c.post(
            "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")}
        )
        assert r.status_code == 400


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


def test_nvfp4_checkpoint_loads_dequantized_and_is_reported(
    engine, reference, tmp_path, trainer_lp
) -> None:  # type: ignore[no-untyped-def]
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
    d.mkdir()
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(d / "model.safetensors"))
    cfg = reference.config.to_hf_dict() | {
        "quantization_config": {"quant_algo": "NVFP4", "quant_method": "modelopt", "group_size": 16,
                                "ignore": ["lm_head"]}
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    build_tokenizer().save_pretrained(str(d))
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
