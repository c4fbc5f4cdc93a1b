"""Shared test setup: the worker modules for multi-rank tests are importable by name; one tiny
checkpoint for every test that only reads it; and the megatron-backend tests
(``test_grpo_megatron*.py``) share one adapter and one single-process reference run
(session-scoped: made once however many of those files run)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Dense/MoE checkpoint (HF layout, with its tokenizer); tests only read it."""
    from grpo_workers import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("grpo-tiny") / "tiny")


@pytest.fixture(scope="session")
def megatron_adapter(tiny_ckpt: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PEFT adapter for every target of ``megatron_workers.ALL_TARGETS`` with random
    (non-zero) A and B."""
    import torch
    from megatron_workers import ALL_TARGETS

    from posttrain.grpo.trainer import lora_targets
    from posttrain.lora import LoraConfig, attach_lora, export_adapter, save_peft
    from posttrain.models import load_pretrained

    model = load_pretrained(tiny_ckpt)
    targets, modules = lora_targets(model, ALL_TARGETS)
    cfg = LoraConfig(r=8, alpha=16.0, seed=5, b_init="normal", export_dtype=torch.float32)
    path = tmp_path_factory.mktemp("grpo-megatron-adapter") / "adapter"
    save_peft(path, export_adapter(attach_lora(model, cfg, targets)), cfg, target_modules=modules)
    return str(path)


@pytest.fixture(scope="session")
def megatron_reference(tiny_ckpt: str, megatron_adapter: str) -> dict[str, Any]:
    """One GRPO step of the single-process fsdp backend, full and LoRA: the parity reference."""
    from megatron_workers import parity_suite

    from posttrain.interface.testing import run_workers

    runs = [{"train": "full"}, {"train": "lora"}]
    (reference,) = run_workers(
        parity_suite, 1, args=(tiny_ckpt, megatron_adapter, runs), timeout_s=240
    )
    return dict(zip(("full", "lora"), reference, strict=True))
