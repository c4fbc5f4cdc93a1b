"""Engine options and the command line, with SGLang's flag names where they exist.

``python -m posttrain.local_engine --model-path DIR --host 127.0.0.1 --port P``
takes SGLang's ``--enable-lora``, ``--max-loras-per-batch``, ``--max-loaded-loras``,
``--lora-paths NAME=PATH ...``, ``--api-key``, ``--random-seed``,
``--served-model-name``, ``--max-running-requests`` (the batch size; by default
``DEFAULT_MAX_RUNNING`` bounded by KV memory, ``default_max_running``) and
``--max-queued-requests``, plus ``--numerics strict|fast`` (strict: the
batch-invariant fp32 kernels that make logprobs bit-identical to the trainer).
Departure: the host defaults to 127.0.0.1, not SGLang's 127.0.0.1-or-0.0.0.0 mix,
and unknown flags are an error rather than ignored.

argparse rather than typer (the project's CLI library) on purpose: the command line is
SGLang's (``launch`` prints the same argv for SGLang and for this engine, and a conformance
test parses it with SGLang's own ``ServerArgs``), and ``--lora-paths NAME=PATH ...`` takes
several values after one flag, which click/typer options cannot express. ``--help`` gives
every option a help text and its default.

Auth model: a key is optional; it comes from ``--api-key-file FILE`` or
``$POSTTRAIN_API_KEY`` (``posttrain.formats.resolve_api_key``), so ``ps`` never shows it;
SGLang's ``--api-key KEY`` is still taken, with the key in argv. Without it any process that can reach the port may
load weights and adapters from any path the engine can read, so the engine binds
127.0.0.1 by default and ``posttrain up``/``demo`` pass a key. With it, the routes that
change state (weights, adapters, pause/continue, flush) need ``Authorization: Bearer KEY``;
generation and information stay open, as sgl-router in front sends no key.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from posttrain.formats import FormatsConfigError, resolve_api_key
from posttrain.interface import ConfigError

__all__ = ["EngineConfig", "build_parser", "parse_args"]


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
    context_length: int | None = None
    max_running_requests: int | None = None
    """None: ``default_max_running(row_bytes)``, sized to the work and bounded by KV memory."""
    max_queued_requests: int = 256
    max_request_bytes: int = 32 * 1024 * 1024
    max_update_bytes: int = 4 * 1024 * 1024 * 1024
    allowed_media_dir: str | None = None
    max_media_bytes: int = 64 * 1024 * 1024
    media_timeout_s: float = 10.0
    media_workers: int = 2
    update_group_timeout_s: float = 300.0
    num_threads: int = 1
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.lora_paths and not self.enable_lora:
            raise ConfigError("--lora-paths needs --enable-lora")
        for name in ("max_loras_per_batch", "max_loaded_loras", "max_running_requests",
                     "max_queued_requests", "max_request_bytes", "max_media_bytes",
                     "media_workers", "num_threads"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} {value} must be positive")
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError(f"--context-length {self.context_length} must be positive")
        if not 0 < self.media_timeout_s < math.inf:
            raise ConfigError(f"--media-timeout-s {self.media_timeout_s} must be finite and > 0")
        if not 0 < self.update_group_timeout_s < math.inf:
            raise ConfigError(
                f"--update-group-timeout {self.update_group_timeout_s} must be finite and > 0"
            )
        if self.allowed_media_dir is not None and not os.path.isdir(self.allowed_media_dir):
            raise ConfigError(f"--allowed-media-dir {self.allowed_media_dir}: not a directory")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")

    def running_limit(self, kv_row_bytes: int) -> int:
        """The decode batch size: ``--max-running-requests`` if given, else
        ``default_max_running(kv_row_bytes)``."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        return default_max_running(kv_row_bytes)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def adapter_limit(self) -> int:
        return self.max_loaded_loras or max(self.max_loras_per_batch, len(self.lora_paths), 1)


DEFAULT_MAX_RUNNING = 128
"""The most requests one decode batch takes by default (a GRPO step of 16 prompts x 8 samples)."""


KV_BUDGET_BYTES = 2 * 2**30
"""The most KV memory the default batch size may hold (the cache is kept between batches)."""


def kv_budget_bytes() -> int:
    """KV memory the default batch size may take: ``KV_BUDGET_BYTES``, or a quarter of the
    machine's physical memory where that is less."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return KV_BUDGET_BYTES
    return min(KV_BUDGET_BYTES, physical // 4)


def default_max_running(kv_row_bytes: int) -> int:
    """``--max-running-requests`` when not given: ``DEFAULT_MAX_RUNNING``, or fewer when that
    many KV rows (``kv_row_bytes`` each: ``KVCache.row_bytes``, which ``--context-length``
    sets) would pass ``kv_budget_bytes()``; at least 1."""
    return max(1, min(DEFAULT_MAX_RUNNING, kv_budget_bytes() // max(1, kv_row_bytes)))


def _lora_pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        # SGLang also accepts a bare path (name = path); keep that form.
        if not sep and text.strip():
            return text.strip(), text.strip()
        raise argparse.ArgumentTypeError(f"--lora-paths entry {text!r}: expected NAME=PATH")
    return name.strip(), path.strip()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Line breaks of the description kept; an option's default appended unless it is None."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is argparse.SUPPRESS or "(default" in text:
            return text
        if isinstance(default, bool) or default == []:
            return text  # a flag is off, a list empty, unless given
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The command line, SGLang's flag names; every option with its help and default."""
    p = argparse.ArgumentParser(
        prog="python -m posttrain.local_engine",
        description="SGLang-compatible CPU engine for posttrain.models checkpoints.\n"
        "Routes and JSON shapes are SGLang's (/generate, /v1/chat/completions, weight updates).",
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    add("--model-path", required=True, metavar="DIR",
        help="checkpoint directory (posttrain.models layout or an NVFP4 checkpoint), with its "
        "tokenizer")  # fmt: skip
    add("--host", default="127.0.0.1", help="address to bind (keep 127.0.0.1 without --api-key)")
    add("--port", type=int, default=30000, help="TCP port to bind")
    add("--api-key", default=None, metavar="KEY",
        help="bearer token the state-changing routes then require (weights, adapters, pause, "
        "flush); generation and info stay open. Without it any local process may reload "
        "weights. It shows in ps: prefer --api-key-file or $POSTTRAIN_API_KEY (default: none)")  # fmt: skip
    add("--api-key-file", default=None, metavar="FILE",
        help="file holding the bearer token (one token); without it and without --api-key, "
        "$POSTTRAIN_API_KEY if set (default: none)")  # fmt: skip
    add("--served-model-name", default=None, metavar="NAME",
        help="model id reported by /v1/models (default: the model path)")  # fmt: skip
    add("--enable-lora", action="store_true", help="serve LoRA adapters by name (lora_path)")
    add("--max-loras-per-batch", type=int, default=8,
        help="distinct adapters one batch may mix")  # fmt: skip
    add(
        "--max-loaded-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapters held at once (default: max(--max-loras-per-batch, startup adapters))",
    )
    add("--lora-paths", nargs="+", type=_lora_pair, default=[], metavar="NAME=PATH",
        help="PEFT adapter directories to load at start (needs --enable-lora)")  # fmt: skip
    add("--random-seed", type=int, default=0,
        help="base of the per-request default sampling seeds")  # fmt: skip
    add(
        "--numerics",
        choices=["strict", "fast"],
        default="strict",
        help="strict: batch-invariant fp32 kernels, logprobs equal the trainer's bit for bit",
    )
    add("--context-length", type=int, default=None, metavar="N",
        help="KV capacity: tokens per sequence, prompt and output together (default: the "
        "model's max_position_embeddings)")  # fmt: skip
    add("--max-running-requests", type=int, default=None, metavar="N",
        help="samples decoded together (the batch; a request with sampling_params.n counts n) "
        f"(default: {DEFAULT_MAX_RUNNING}, or fewer where that many KV rows of "
        "--context-length tokens would pass 2 GiB or a quarter of physical memory)")  # fmt: skip
    add("--max-queued-requests", type=int, default=256,
        help="prompts waiting; past it a request gets 503 at once")  # fmt: skip
    add("--max-request-bytes", type=int, default=32 * 1024 * 1024, metavar="BYTES",
        help="largest JSON request body; bigger is 413 before it is parsed")  # fmt: skip
    add("--allowed-media-dir", default=None, metavar="DIR",
        help="the only directory image_data/audio_data file paths may name (regular files, "
        "no symlinks); without it file-path media is refused (default: none)")  # fmt: skip
    add("--max-media-bytes", type=int, default=64 * 1024 * 1024, metavar="BYTES",
        help="largest media file a path may name")  # fmt: skip
    add("--media-timeout-s", type=float, default=10.0, metavar="S",
        help="deadline for reading and decoding one request's media")  # fmt: skip
    add("--media-workers", type=int, default=2, metavar="N",
        help="threads that decode media (a pool of their own, apart from weight routes)")  # fmt: skip
    add("--update-group-timeout", type=float, default=300.0, metavar="S",
        help="how long joining a weight-update group or one broadcast in it may take")  # fmt: skip
    add("--num-threads", type=int, default=1, metavar="N", help="torch CPU threads")
    add("--log-level", default="warning", help="uvicorn log level")
    return p


def parse_args(argv: Sequence[str] | None = None) -> EngineConfig:
    """Parse the command line into an EngineConfig (errors exit with status 2, like argparse)."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.api_key is not None and a.api_key_file is not None:
        p.error("give --api-key or --api-key-file, not both")
    try:
        api_key = a.api_key if a.api_key is not None else resolve_api_key(a.api_key_file)
    except FormatsConfigError as e:
        p.error(str(e))
    try:
        return EngineConfig(
            model_path=a.model_path,
            host=a.host,
            port=a.port,
            api_key=api_key,
            served_model_name=a.served_model_name,
            enable_lora=a.enable_lora,
            max_loras_per_batch=a.max_loras_per_batch,
            max_loaded_loras=a.max_loaded_loras,
            lora_paths=dict(a.lora_paths),
            random_seed=a.random_seed,
            numerics=a.numerics,
            context_length=a.context_length,
            max_running_requests=a.max_running_requests,
            max_queued_requests=a.max_queued_requests,
            max_request_bytes=a.max_request_bytes,
            allowed_media_dir=a.allowed_media_dir,
            max_media_bytes=a.max_media_bytes,
            media_timeout_s=a.media_timeout_s,
            media_workers=a.media_workers,
            update_group_timeout_s=a.update_group_timeout,
            num_threads=a.num_threads,
            log_level=a.log_level,
        )
    except ConfigError as e:
        p.error(str(e))
