"""``--backend megatron`` on an MLA model (a tiny GLM-4.7-Flash: MLA, one dense layer, then
DeepSeek-style MoE layers) at TP=2 on gloo ranks against the single-process fsdp backend, same
batch: the loss within a relative 1e-6, every gradient (full HF-named tensors) within a
relative L2 of 1e-5, and the exported weights bitwise the single process's.

The heads split as megatron-core splits MLA: ``q_b_proj`` and ``kv_b_proj`` column parallel,
``o_proj`` row parallel, the latent projections and the MoE replicated. Expert parallel and
sequence parallel on MLA: test_grpo_megatron_mla_parallel.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import megatron_workers as workers
import pytest
import torch

from posttrain.interface.testing import run_workers
from posttrain.models import VOCAB_SIZE, ModelConfig, build_model, build_tokenizer

if importlib.util.find_spec("megatron") is None:  # the grpo extra "megatron" (Linux)
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(300)]

GLM = ModelConfig.mla_tiny(vocab_size=VOCAB_SIZE, max_position_embeddings=64)


@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("glm") / "glm"
    build_model(GLM, seed=3).save_pretrained(path, tokenizer=build_tokenizer())
    return str(path)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den else float(a.double().norm())


def test_tp2_matches_the_single_process(glm_ckpt: str) -> None:
    import posttrain.grpo.megatron.layers  # noqa: F401  (imported once; forked ranks inherit it)

    (ref,) = run_workers(workers.parity_suite, 1, args=(glm_ckpt, "", [{"train": "full"}]),
                         timeout_s=240)[0]  # fmt: skip
    run = {"train": "full", "backend": "megatron", "tensor_model_parallel_size": 2}
    (got,) = run_workers(workers.parity_suite, 2, args=(glm_ckpt, "", [run]), timeout_s=240)[0]
    assert any("kv_b_proj" in name for name in ref["grads"])
    assert_parity(got, ref)


def assert_parity(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """``got`` (a ``parity_suite`` run) matches the single process's ``ref``: loss rel 1e-6,
    every gradient rel L2 1e-5, exported weights / adapter bitwise."""
    assert got["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6, abs=1e-9)
    assert got["metrics"]["train_tokens"] == ref["metrics"]["train_tokens"]
    assert got["grads"].keys() == ref["grads"].keys()
    worst = {name: rel_l2(got["grads"][name], g) for name, g in ref["grads"].items()}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert got["weights"].keys() == ref["weights"].keys()
    for name, value in ref["weights"].items():
        assert torch.equal(got["weights"][name], value), name
