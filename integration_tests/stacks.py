"""A ``posttrain up`` stack for integration tests: a tiny checkpoint (and adapter) to serve,
the launcher as a subprocess with its URLs and key file read from stdout, and a check that a
process is gone. Shared by the ``posttrain up`` and hostile-stack tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import posttrain.models as models
from posttrain.formats import peft_key, write_peft_adapter
from posttrain.interface import LoraSpec


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
        tensors[peft_key(name, "A")] = torch.randn(4, fan_in, generator=gen)
        tensors[peft_key(name, "B")] = torch.randn(fan_out, 4, generator=gen)
    spec = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj",))
    return model_dir, write_peft_adapter(root / "adapter", tensors, spec)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Stack:
    """A ``posttrain up`` process: its URLs and key file (from stdout) and its log (stderr)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "posttrain.launch", "up", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.err_lines: list[str] = []
        self.urls: dict[str, str] = {}
        self.key_file: Path | None = None
        self._key = ""
        # Logs go to stderr; an unread pipe would stall the launcher.
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        self.err_lines.extend(self.proc.stderr)

    def wait_ready(self, timeout_s: float = 200) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=30)
                self.reader.join(timeout=10)
                tail = "".join(self.err_lines)[-4000:]
                pytest.fail(f"posttrain up exited early ({self.proc.returncode}):\n{tail}")
            if line.startswith("ready"):
                if self.key_file is not None:
                    self._key = self.key_file.read_text().strip()  # it is removed at stop
                return
            name, value = line.split()
            if name == "api-key-file":
                self.key_file = Path(value)
            else:
                self.urls[name] = value
        pytest.fail("posttrain up was not ready in time")

    @property
    def key(self) -> str:
        assert self._key, "no api-key-file line before ready"
        return self._key

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        self.reader.join(timeout=10)
        return "".join(self.err_lines)
