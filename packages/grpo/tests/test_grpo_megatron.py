"""``--backend megatron`` on gloo ranks against the single-process fsdp backend, same batch.

TP=2 and TP=2 with sequence parallel, full-parameter and LoRA (every linear of the dense MLP
and attention adapted, B factors non-zero): the loss and every gradient (gathered to full
HF / PEFT-named tensors) match the single process within a relative L2 of 1e-5, and the
exported weights / adapter are bitwise the single process's. A full checkpoint saved under
TP=2 loads under TP=1 (and back) with bitwise the same weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import megatron_workers as workers
import pytest
import torch

from posttrain.interface.testing import run_workers
from posttrain.models import VOCAB_SIZE, ModelConfig

if importlib.util.find_spec("megatron") is None:  # the grpo extra "megatron" (Linux)
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(300)]
TOL = 1e-5
RUNS = [
    {"train": "full", "tensor_model_parallel_size": 2},
    {"train": "full", "tensor_model_parallel_size": 2, "sequence_parallel": True},
    {"train": "lora", "tensor_model_parallel_size": 2},
    {"train": "lora", "tensor_model_parallel_size": 2, "sequence_parallel": True},
]


@pytest.fixture(scope="module")
def results(
    tiny_ckpt: str, megatron_adapter: str, megatron_reference: dict[str, Any]
) -> dict[str, Any]:
    # megatron-core is imported once here (~10 s), so the forked ranks inherit it warm.
    import posttrain.grpo.megatron.layers  # noqa: F401

    runs = [{**r, "backend": "megatron"} for r in RUNS]
    megatron = run_workers(
        workers.parity_suite, 2, args=(tiny_ckpt, megatron_adapter, runs), timeout_s=240
    )[0]
    return {"reference": megatron_reference, "megatron": megatron}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den else float(a.double().norm())


@pytest.mark.parametrize("index", range(len(RUNS)), ids=["full", "full-sp", "lora", "lora-sp"])
def test_loss_and_every_gradient_match_the_single_process(
    results: dict[str, Any], index: int
) -> None:
    run = RUNS[index]
    ref = results["reference"][run["train"]]
    got = results["megatron"][index]
    assert got["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=TOL, abs=1e-8)
    assert got["metrics"]["train_tokens"] == ref["metrics"]["train_tokens"]
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=TOL)
    assert got["grads"].keys() == ref["grads"].keys()
    worst = {name: rel_l2(got["grads"][name], g) for name, g in ref["grads"].items()}
    assert max(worst.values()) <= TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert sum(float(g.abs().sum()) > 0 for g in ref["grads"].values()) > len(worst) // 2


@pytest.mark.parametrize("index", range(len(RUNS)), ids=["full", "full-sp", "lora", "lora-sp"])
def test_exported_weights_are_the_single_process_bytes(results: dict[str, Any], index: int) -> None:
    ref = results["reference"][RUNS[index]["train"]]["weights"]
    got = results["megatron"][index]["weights"]
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), name


def test_a_tp2_checkpoint_loads_under_tp1_and_back(tiny_ckpt: str, tmp_path: Path) -> None:
    import posttrain.grpo.megatron.layers  # noqa: F401

    saved = run_workers(workers.save_then_reload, 2, args=(tiny_ckpt, str(tmp_path / "tp2"), 2),
                        timeout_s=200)[0]  # fmt: skip
    one = run_workers(workers.load_under, 1, args=(tiny_ckpt, saved["path"], 1), timeout_s=200)[0]
    # the weights are bitwise the TP=2 ones; TP=1 logprobs are the single-process model's
    assert one["extra"] is False  # another layout: weights only, fresh optimizer
    for name, value in saved["weights"].items():
        assert torch.equal(one["weights"][name], value), name
    assert torch.equal(one["logprobs"], one["single"])
    # TP=2 adds two partial sums where TP=1 runs one tree: last-bit differences only
    torch.testing.assert_close(one["logprobs"], saved["logprobs"], rtol=0, atol=1e-5)
    back = run_workers(workers.load_under, 2, args=(tiny_ckpt, saved["path"], 2), timeout_s=200)[0]
    assert back["extra"] is True  # the saved layout: optimizer and RNG restored too
    assert torch.equal(back["logprobs"], saved["logprobs"])


def test_full_weights_reach_an_engine_as_the_single_process_bytes(tiny_ckpt: str) -> None:
    import posttrain.grpo.megatron.layers  # noqa: F401
    from posttrain.models import load_pretrained

    got = run_workers(workers.sync_full, 2, args=(tiny_ckpt, 2, True), timeout_s=200)[0]
    want = load_pretrained(tiny_ckpt).hf_state_dict()
    assert got["version"] == 7
    assert got["received"].keys() == want.keys()
    assert all(torch.equal(got["received"][k], v) for k, v in want.items())


def test_layouts_tensor_parallel_cannot_split_are_refused_by_field() -> None:
    from posttrain.grpo import GrpoConfigError
    from posttrain.grpo.megatron.model import check_tensor_parallel_config, local_config

    cfg = ModelConfig.tiny(vocab_size=VOCAB_SIZE)
    local = local_config(cfg, 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert local.intermediate_size == cfg.intermediate_size // 2
    with pytest.raises(
        GrpoConfigError, match=r"num_key_value_heads=2 \(layer 0\) is not divisible"
    ):
        check_tensor_parallel_config(cfg, 4)
    with pytest.raises(GrpoConfigError, match="intermediate_size=63 is not divisible"):
        check_tensor_parallel_config(cfg.replace(intermediate_size=63), 2)
    with pytest.raises(GrpoConfigError, match="sconv_kernel_size=4 has no tensor-parallel split"):
        check_tensor_parallel_config(ModelConfig.inkling_tiny(), 2)


@pytest.mark.parametrize(("train", "sp"), [("full", True), ("lora", True), ("lora", False)])
def test_replicated_tensors_stay_identical_after_a_step(
    tiny_ckpt: str, train: str, sp: bool
) -> None:
    import posttrain.grpo.megatron.layers  # noqa: F401

    ok = run_workers(workers.replicas_after_a_step, 2, args=(tiny_ckpt, train, sp), timeout_s=200)
    assert ok == [True, True]


def test_the_gradient_comparison_bites(
    tiny_ckpt: str, megatron_adapter: str, results: dict[str, Any]
) -> None:
    # Leaving out the TP sum of the head-shared q/k norm grads must fail the comparison above.
    got = run_workers(
        workers.without_tp_sums, 2, args=(tiny_ckpt, megatron_adapter), timeout_s=200
    )[0]
    ref = results["reference"]["full"]["grads"]
    worst = {name: rel_l2(got["grads"][name], g) for name, g in ref.items()}
    assert max(worst.values()) > 1e-2
    assert all("norm" in name for name, v in worst.items() if v > TOL)


def test_a_tp2_adapter_checkpoint_loads_under_tp1(tiny_ckpt: str, tmp_path: Path) -> None:
    import posttrain.grpo.megatron.layers  # noqa: F401

    saved = run_workers(workers.save_then_reload, 2,
                        args=(tiny_ckpt, str(tmp_path / "tp2"), 2, 1, "lora"), timeout_s=200)[0]  # fmt: skip
    one = run_workers(workers.load_under, 1, args=(tiny_ckpt, saved["path"], 1, 1, "lora"),
                      timeout_s=200)[0]  # fmt: skip
    assert one["extra"] is False  # another layout: the adapter only, fresh optimizer
    assert one["weights"].keys() == saved["weights"].keys()
    for name, value in saved["weights"].items():
        assert torch.equal(one["weights"][name], value), name
    torch.testing.assert_close(one["logprobs"], saved["logprobs"], rtol=0, atol=1e-5)
