"""Shared fixtures: one tiny checkpoint (with tokenizer) and in-process engine clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from posttrain.local_engine import EngineConfig, build_app
from posttrain.models import (
    DecoderModel,
    ModelConfig,
    build_model,
    build_tokenizer,
    load_pretrained,
)

TINY = {"torch_dtype": "bfloat16", "max_position_embeddings": 48}


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Dense/MoE checkpoint (bf16 params) saved with its tokenizer."""
    d = tmp_path_factory.mktemp("ckpt")
    build_model(ModelConfig.tiny(**TINY), seed=0).save_pretrained(d, tokenizer=build_tokenizer())
    return d


@pytest.fixture(scope="session")
def other_weights() -> dict[str, torch.Tensor]:
    """A second set of weights (seed 1) for updates, under HF names."""
    return build_model(ModelConfig.tiny(**TINY), seed=1).hf_state_dict()


@pytest.fixture
def reference(ckpt_dir: Path) -> DecoderModel:
    """The trainer's model: the same checkpoint, loaded by posttrain.models."""
    return load_pretrained(ckpt_dir)


EngineFactory = Callable[..., AbstractContextManager[TestClient]]


@pytest.fixture(scope="session")
def engine(ckpt_dir: Path) -> EngineFactory:
    """``with engine(**config) as client`` runs an in-process engine over ckpt_dir."""

    @contextmanager
    def start(**overrides: Any) -> Iterator[TestClient]:
        cfg = EngineConfig(model_path=str(overrides.pop("model_path", ckpt_dir)), **overrides)
        with TestClient(build_app(cfg)) as client:
            yield client

    return start


@pytest.fixture(scope="session")
def trainer_lp() -> Callable[..., list[float]]:
    """``trainer_lp(model, ids, lora=None)``: the training forward's logprobs of one sequence.

    Entry 0 is the 0.0 placeholder (nothing predicts the first token).
    """

    def compute(model: DecoderModel, ids: list[int], lora: Any = None) -> list[float]:
        with torch.no_grad():
            out: list[float] = model.forward_logprobs(
                torch.tensor(ids), [len(ids)], lora=lora
            ).tolist()
        return out

    return compute
