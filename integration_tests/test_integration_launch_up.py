"""``posttrain up`` end to end on CPU: two local engines, the stock sgl-router and the session
router; a chat through a session; Ctrl-C; no process it started survives.

The launch package never imports its siblings; this test needs them installed to have
something to start, so it lives in integration_tests, where the whole workspace is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import safetensors.torch as safetensors_torch
import torch

import posttrain.models as models

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(240)]
ADAPTER = "policy"


def write_checkpoint(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE-layout checkpoint with a tokenizer, and a PEFT LoRA adapter for it."""
    cfg = models.ModelConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=32,
        num_experts=2, num_experts_per_tok=1, mlp_only_layers=(0,),
        max_position_embeddings=512, eos_token_id=3,
    )  # fmt: skip
    model_dir = models.save_pretrained(
        models.build_model(cfg, seed=0), root / "model", tokenizer=models.build_tokenizer()
    )
    gen = torch.Generator().manual_seed(1)
    targets = {n: s for n, s in models.lora_targets(cfg).items() if n.endswith("q_proj")}
    tensors = {}
    for name, (fan_in, fan_out) in targets.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, fan_in, generator=gen)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, 4, generator=gen)
    adapter = root / "adapter"
    adapter.mkdir()
    safetensors_torch.save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"],
             "lora_dropout": 0.0, "bias": "none"}
        )
    )  # fmt: skip
    return model_dir, adapter


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_up_serves_a_session_chat_and_stops_everything(tmp_path: Path) -> None:
    model_dir, adapter = write_checkpoint(tmp_path)
    up = subprocess.Popen(
        [sys.executable, "-m", "posttrain.launch", "up", "--model-path", str(model_dir),
         "--engines", "2", "--lora", f"{ADAPTER}={adapter}", "--engine", "local-engine",
         "--ready-timeout-s", "150"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    err_lines: list[str] = []

    def drain() -> None:  # logs go to stderr; an unread pipe would stall the launcher
        assert up.stderr is not None
        err_lines.extend(up.stderr)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    urls: dict[str, str] = {}
    children: list[int] = []
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                up.wait(timeout=30)
                reader.join(timeout=10)
                tail = "".join(err_lines)[-4000:]
                pytest.fail(f"posttrain up exited early ({up.returncode}):\n{tail}")
            if line.startswith("ready"):
                break
            name, url = line.split()
            urls[name] = url
        assert set(urls) == {"engine-0", "engine-1", "router", "session-router"}
        children = [c.pid for c in psutil.Process(up.pid).children(recursive=True)]
        assert len(children) >= 4

        base = urls["session-router"]
        with httpx.Client(timeout=60.0) as client:
            session = client.post(f"{base}/sessions").json()["session_id"]
            reply = client.post(
                f"{base}/sessions/{session}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["role"] == "assistant"
            record = client.get(f"{base}/sessions/{session}").json()["records"][0]
            assert record["request"]["lora_path"] == ADAPTER  # the adapter reached the engine
            assert record["request"]["extra_key"] == f"{ADAPTER}:v0"  # the startup version
            assert client.delete(f"{base}/sessions/{session}").status_code == 204
            workers = client.get(f"{urls['router']}/workers").json()
            assert len(json.dumps(workers)) > 0
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
        reader.join(timeout=10)
    err = "".join(err_lines)
    assert up.returncode == 0, err[-4000:]
    assert err.count("registered http://127.0.0.1:") == 2
    assert "stopped every process" in err
    assert all(gone(pid) for pid in children), [p for p in children if not gone(p)]
