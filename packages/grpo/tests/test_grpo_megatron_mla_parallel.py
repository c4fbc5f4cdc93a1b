"""``--backend megatron`` on a tiny DeepSeek-V3 (MLA with q/kv latents, layer 0 dense
(``first_k_dense_replace=1``), then 4 routed experts in 2 groups (group-limited top-2 of one
group) and a shared expert) against the single-process fsdp backend on the same batch: on 2
gloo ranks EP=2 and TP=2 with sequence parallel, full and LoRA, and LoRA at TP=2 without it
(full TP=2: test_grpo_megatron_mla); on 4 ranks TP=2 x EP=2 with sequence parallel, full. A
full checkpoint saved under EP=2 loads under EP=1 with bitwise the same weights and logprobs.
LoRA adapts ``q_b_proj``, ``kv_b_proj``, ``o_proj`` and the dense MLP (B factors non-zero).

The loss within a relative 1e-6, every gradient (full HF / PEFT-named tensors) within a relative
L2 of 1e-5, and the exported weights / adapter bitwise the single process's. EP splits the
DeepSeek-style routed experts (``ExpertParallelMoe`` in its DeepSeek form); SP keeps the latent
projections on each rank's tokens and gathers the latents and the rope key.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import megatron_workers as workers
import pytest
import torch
from test_grpo_megatron_mla import assert_parity

from posttrain.interface.testing import run_workers
from posttrain.models import VOCAB_SIZE, ModelConfig, build_model, build_tokenizer

if importlib.util.find_spec("megatron") is None:  # the grpo extra "megatron" (Linux)
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(300)]

DEEPSEEK = ModelConfig.mla_tiny(
    "deepseek_v3", vocab_size=VOCAB_SIZE, max_position_embeddings=64, num_hidden_layers=3,
    n_group=2, topk_group=1,
)  # fmt: skip
TARGETS = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RUNS = [
    {"train": "full", "expert_model_parallel_size": 2},
    {"train": "lora", "expert_model_parallel_size": 2},
    {"train": "lora", "tensor_model_parallel_size": 2},
    {"train": "full", "tensor_model_parallel_size": 2, "sequence_parallel": True},
    {"train": "lora", "tensor_model_parallel_size": 2, "sequence_parallel": True},
]
FOUR = [  # 4 ranks: TP2 x EP2 with sequence parallel
    {"train": "full", "tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
     "sequence_parallel": True},
]  # fmt: skip
IDS = ["ep2-full", "ep2-lora", "tp2-lora", "tp2-sp-full", "tp2-sp-lora", "tp2ep2-sp-full"]


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The checkpoint and a PEFT adapter on ``TARGETS`` with random (non-zero) A and B."""
    from posttrain.grpo.trainer import lora_targets
    from posttrain.lora import LoraConfig, attach_lora, export_adapter, save_peft

    root = tmp_path_factory.mktemp("deepseek")
    model = build_model(DEEPSEEK, seed=3)
    model.save_pretrained(root / "model", tokenizer=build_tokenizer())
    targets, modules = lora_targets(model, TARGETS)
    cfg = LoraConfig(r=8, alpha=16.0, seed=5, b_init="normal", export_dtype=torch.float32)
    adapter = root / "adapter"
    save_peft(adapter, export_adapter(attach_lora(model, cfg, targets)), cfg,
              target_modules=modules)  # fmt: skip
    return str(root / "model"), str(adapter)


@pytest.fixture(scope="module")
def results(deepseek_ckpt: tuple[str, str]) -> dict[str, Any]:
    import posttrain.grpo.megatron.layers  # noqa: F401 (megatron-core once, before forking)

    refs = [{"train": t, "lora_targets": TARGETS} for t in ("full", "lora")]
    (ref,) = run_workers(workers.parity_suite, 1, args=(*deepseek_ckpt, refs), timeout_s=240)
    meg = lambda runs: [{**r, "backend": "megatron", "lora_targets": TARGETS} for r in runs]  # noqa: E731
    two = run_workers(workers.parity_suite, 2, args=(*deepseek_ckpt, meg(RUNS)), timeout_s=240)
    four = run_workers(workers.parity_suite, 4, args=(*deepseek_ckpt, meg(FOUR)), timeout_s=240)
    return {"reference": dict(zip(("full", "lora"), ref, strict=True)), "runs": two[0] + four[0]}


@pytest.mark.parametrize("index", range(len(IDS)), ids=IDS)
def test_ep2_and_sequence_parallel_match_the_single_process(
    results: dict[str, Any], index: int
) -> None:
    train = [*RUNS, *FOUR][index]["train"]
    ref = results["reference"][train]
    if train == "full":  # the routed experts and the rope key's path are there
        assert any(".mlp.experts.3." in name for name in ref["grads"])
        assert any("kv_a_proj_with_mqa" in name for name in ref["grads"])
    assert_parity(results["runs"][index], ref)


def test_an_ep2_checkpoint_loads_under_ep1(deepseek_ckpt: tuple[str, str], tmp_path: Path) -> None:
    import posttrain.grpo.megatron.layers  # noqa: F401

    ckpt = deepseek_ckpt[0]
    saved = run_workers(workers.save_then_reload, 2, args=(ckpt, str(tmp_path / "ep2"), 1, 2),
                        timeout_s=200)[0]  # fmt: skip
    (one,) = run_workers(workers.load_under, 1, args=(ckpt, saved["path"], 1, 1), timeout_s=200)
    assert one["extra"] is False  # another layout: weights only
    assert one["weights"].keys() == saved["weights"].keys()
    for name, value in saved["weights"].items():
        assert torch.equal(one["weights"][name], value), name
    assert torch.equal(one["logprobs"], one["single"])
    assert torch.equal(one["logprobs"], saved["logprobs"])  # EP reorders no sum
