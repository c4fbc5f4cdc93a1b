"""Assemble the served engine from a config, and run it under uvicorn.

A checkpoint or startup adapter that cannot be served (missing, unreadable, NaN/Inf) stops
``main`` with a one-line ``error: ...`` and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette

from posttrain.interface import PosttrainError
from posttrain.local_engine._app import ServerContext, create_app
from posttrain.local_engine._codec import load_codec
from posttrain.local_engine._config import EngineConfig, parse_args
from posttrain.local_engine._engine import Engine
from posttrain.local_engine._loader import load_model, read_checkpoint
from posttrain.local_engine._lora import load_peft_adapter

__all__ = ["build_app", "main", "serve"]


def load_config_dict(model_path: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` object (already validated by ``load_model``)."""
    data: dict[str, Any] = json.loads((Path(model_path) / "config.json").read_text())
    return data


def build_app(config: EngineConfig) -> Starlette:
    """Load the checkpoint, its tokenizer and the startup adapters; return the ASGI app."""
    model, report = load_model(
        config.model_path, numerics=config.numerics, context_length=config.context_length
    )
    codec = load_codec(config.model_path)
    eos: list[int] = list(codec.eos_token_ids) if codec is not None else []
    if model.config.eos_token_id is not None and model.config.eos_token_id not in eos:
        eos.append(model.config.eos_token_id)
    engine = Engine(
        model,
        eos_token_ids=eos,
        decode_text=None if codec is None else codec.decode,
        max_loras=config.adapter_limit,
    )
    if report is not None:
        engine.take_nvfp4_updates(report.wire)
    for name, path in config.lora_paths.items():
        engine.put_adapter(load_peft_adapter(name, path, engine.lora_targets))
    specs = {k: s.dtype for k, s in engine.param_specs().items()}
    # the checkpoint's own type (qwen3_moe, or mellum for dense + MoE layers), as SGLang reports it
    hf = load_config_dict(config.model_path)
    ctx = ServerContext(
        config=config,
        engine=engine,
        codec=codec,
        model_type=str(hf.get("model_type", "qwen3_moe")),
        architectures=list(hf.get("architectures") or ["Qwen3MoeForCausalLM"]),
        quantization=None if report is None else report.to_json(),
        load_checkpoint=lambda path: read_checkpoint(path, specs)[0],
    )
    return create_app(ctx)


def serve(config: EngineConfig) -> None:
    """Run the engine in this process until interrupted."""
    torch.set_num_threads(config.num_threads)
    app = build_app(config)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        serve(config)
    except PosttrainError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
