"""Engine options and the command line, with SGLang's flag names where they exist.

``python -m posttrain.local_engine --model-path DIR --host 127.0.0.1 --port P``
takes SGLang's ``--enable-lora``, ``--max-loras-per-batch``, ``--max-loaded-loras``,
``--lora-paths NAME=PATH ...``, ``--api-key``, ``--random-seed``,
``--served-model-name``, ``--max-running-requests`` (the batch size) and
``--max-queued-requests``, plus ``--numerics strict|fast`` (strict: the
batch-invariant fp32 kernels that make logprobs bit-identical to the trainer).
Departure: the host defaults to 127.0.0.1, not SGLang's 127.0.0.1-or-0.0.0.0 mix,
and unknown flags are an error rather than ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from posttrain.interface import ConfigError

__all__ = ["EngineConfig", "parse_args"]


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Everything the engine process is configured with."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    enable_lora: bool = False
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_paths: dict[str, str] = field(default_factory=dict)
    random_seed: int = 0
    numerics: Literal["strict", "fast"] = "strict"
    max_running_requests: int = 8
    max_queued_requests: int = 256
    max_request_bytes: int = 32 * 1024 * 1024
    max_update_bytes: int = 4 * 1024 * 1024 * 1024
    shm_dir: str = "/dev/shm"
    num_threads: int = 1
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.lora_paths and not self.enable_lora:
            raise ConfigError("--lora-paths needs --enable-lora")
        for name in ("max_loras_per_batch", "max_running_requests", "max_queued_requests"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def adapter_limit(self) -> int:
        return self.max_loaded_loras or max(self.max_loras_per_batch, len(self.lora_paths), 1)


def _lora_pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        # SGLang also accepts a bare path (name = path); keep that form.
        if not sep and text.strip():
            return text.strip(), text.strip()
        raise argparse.ArgumentTypeError(f"--lora-paths entry {text!r}: expected NAME=PATH")
    return name.strip(), path.strip()


def parse_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """Parse the command line into an EngineConfig (errors exit with status 2, like argparse)."""
    p = argparse.ArgumentParser(
        prog="python -m posttrain.local_engine",
        description="SGLang-compatible CPU engine for posttrain.models checkpoints.",
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-paths", nargs="+", type=_lora_pair, default=[])
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--numerics", choices=["strict", "fast"], default="strict")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--max-queued-requests", type=int, default=256)
    p.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024)
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    try:
        return EngineConfig(
            model_path=a.model_path,
            host=a.host,
            port=a.port,
            api_key=a.api_key,
            served_model_name=a.served_model_name,
            enable_lora=a.enable_lora,
            max_loras_per_batch=a.max_loras_per_batch,
            max_loaded_loras=a.max_loaded_loras,
            lora_paths=dict(a.lora_paths),
            random_seed=a.random_seed,
            numerics=a.numerics,
            max_running_requests=a.max_running_requests,
            max_queued_requests=a.max_queued_requests,
            max_request_bytes=a.max_request_bytes,
            shm_dir=a.shm_dir,
            num_threads=a.num_threads,
            log_level=a.log_level,
        )
    except ConfigError as e:
        p.error(str(e))
