"""``posttrain-formats`` alone reads what the capability packages write (issue #16).

A trainer that only wants samples or adapters installs ``posttrain-interface`` and
``posttrain-formats``, nothing else. Here the real writers run in the workspace:

- session-router (its ASGI app, with a real local-engine under uvicorn as its upstream) holds a
  two-turn chat and returns the trajectory from ``POST /sessions/{id}/samples`` (samples/1);
- lora-core attaches LoRA to a small model, steps it so B is non-zero, and ``save_peft`` writes
  the PEFT directory.

Then a fresh venv gets ``pip install ./packages/interface ./packages/formats`` (uv's pip with the
lock's versions), is checked to hold no other posttrain package, and reads both with
``decode_samples`` and ``read_peft_adapter``; what it reads must equal what the writers meant,
value for value and bit for bit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_packages_alone import _env  # the same venv recipe as every package-alone test

import posttrain.local_engine as local_engine
import posttrain.models as models
from posttrain.interface.testing import AppServer, free_port
from posttrain.lora import LoraConfig, LoraGroups, attach_lora, export_adapter, save_peft
from posttrain.session_router import SessionRouterConfig, create_app

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parent.parent

READER = r"""
import hashlib, importlib.metadata as md, json, sys

import torch

from posttrain.formats import decode_samples, read_peft_adapter

def sha(t):
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

out = {"posttrain": sorted(d.metadata["Name"] for d in md.distributions()
                           if d.metadata["Name"].startswith("posttrain-"))}
decoded = decode_samples(open(sys.argv[1], "rb").read())
out["samples"] = [s.to_dict() for s in decoded.samples]
adapter = read_peft_adapter(sys.argv[2])
out["spec"] = [adapter.spec.r, adapter.spec.alpha, sorted(adapter.spec.target_modules)]
out["factors"] = {f"{module}.{which}": [str(t.dtype), list(t.shape), sha(t)]
                  for module, pair in adapter.modules.items() for which, t in zip("AB", pair)}
print(json.dumps(out))
"""


def _sha(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def _samples_from_session_router(root: Path) -> tuple[bytes, list[dict[str, Any]]]:
    """Two chat turns through the real session server in front of a real local engine."""
    cfg = models.ModelConfig.tiny(max_position_embeddings=256)
    model_dir = models.save_pretrained(
        models.build_model(cfg, seed=0), root / "model", tokenizer=models.build_tokenizer()
    )
    port = free_port()
    engine = AppServer(
        local_engine.build_app(
            local_engine.parse_args(["--model-path", str(model_dir), "--port", str(port)])
        ),
        port=port,
    )
    session_cfg = SessionRouterConfig(upstream_url=engine.url, tokenizer=str(model_dir))

    async def chat() -> tuple[bytes, list[dict[str, Any]]]:
        app = create_app(session_cfg)
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://sr", timeout=60
            ) as c:
                sid = (await c.post("/sessions")).json()["session_id"]
                url = f"/sessions/{sid}/v1/chat/completions"
                messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
                for follow_up in ("And again?", None):
                    body = {"messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": 3}
                    reply = await c.post(url, json=body)
                    assert reply.status_code == 200, reply.text
                    messages.append(reply.json()["choices"][0]["message"])
                    if follow_up:
                        messages.append({"role": "user", "content": follow_up})
                collected = await c.post(
                    f"/sessions/{sid}/samples", json={"metadata": {"source": "session-router"}}
                )
                assert collected.status_code == 200, collected.text
                record = (await c.get(f"/sessions/{sid}")).json()
                return collected.content, record["records"]
        finally:
            await app.state.server.aclose()

    with engine:
        return asyncio.run(asyncio.wait_for(chat(), timeout=120))


def _adapter_from_lora_core(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """lora-core's own path: attach, one optimizer step (B leaves zero), export, save_peft."""
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("q_proj", torch.nn.Linear(16, 8, bias=False))
    model.add_module("v_proj", torch.nn.Linear(16, 8, bias=False))
    lora_cfg = LoraConfig(r=4, alpha=8.0, export_dtype=torch.float32)
    handle = attach_lora(model, lora_cfg, ["q_proj", "v_proj"], LoraGroups())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    x = torch.randn(5, 16)
    (model.q_proj(x).square().sum() + model.v_proj(x).sum()).backward()
    opt.step()
    adapter = export_adapter(handle)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())
    target = root / "adapter"
    save_peft(target, adapter, lora_cfg, target_modules=["q_proj", "v_proj"])
    return target, adapter


@pytest.mark.timeout(900)
def test_formats_alone_reads_a_session_router_sample_and_a_lora_core_adapter(
    uv: str, lock_constraints: Path, tmp_path: Path
) -> None:
    payload, records = _samples_from_session_router(tmp_path / "sr")
    samples_file = tmp_path / "sample.safetensors"
    samples_file.write_bytes(payload)
    adapter_dir, adapter = _adapter_from_lora_core(tmp_path / "lora")

    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)],
                   check=True, timeout=120)  # fmt: skip
    env = _env(venv, lock_constraints)
    subprocess.run(
        [uv, "pip", "install", "./packages/interface", "./packages/formats"],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    reader = tmp_path / "read.py"
    reader.write_text(READER)
    done = subprocess.run(
        [str(venv / "bin" / "python"), str(reader), str(samples_file), str(adapter_dir)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    assert seen["posttrain"] == ["posttrain-formats", "posttrain-interface"]
    # the sample: one trajectory over both turns, its logprobs exactly the engine's
    (sample,) = seen["samples"]
    engine_logprobs = [
        entry[0]
        for rec in records
        for entry in rec["response"]["meta_info"]["output_token_logprobs"]
    ]
    trained = [
        lp for lp, m in zip(sample["rollout_logprobs"], sample["loss_mask"], strict=True) if m
    ]
    assert trained == engine_logprobs[: len(trained)]
    assert len(trained) >= len(records)  # both turns contributed tokens
    assert sample["metadata"]["source"] == "session-router"
    assert sample["prompt_ids"] == records[0]["request"]["input_ids"]
    # the adapter: the same spec and, factor by factor, the same bytes lora-core exported
    assert seen["spec"] == [4, 8.0, ["q_proj", "v_proj"]]
    expected = {}
    for key, tensor in adapter.items():
        module, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        expected[f"{module}.{which[0]}"] = [str(tensor.dtype), list(tensor.shape), _sha(tensor)]
    assert seen["factors"] == expected
    shutil.rmtree(venv, ignore_errors=True)
