"""The trainer on gloo ranks: exact train/serve parity, and the same update as one rank."""

from __future__ import annotations

from typing import Any

import grpo_workers as workers
import pytest
import torch

from posttrain.grpo import GrpoConfigError
from posttrain.grpo.trainer import lora_targets, micro_batches
from posttrain.interface.testing import run_workers

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module", params=["lora", "full"])
def runs(request: pytest.FixtureRequest, tiny_ckpt: str) -> dict[str, Any]:
    two = run_workers(workers.two_steps, 2, args=(tiny_ckpt, request.param), timeout_s=240)
    one = run_workers(workers.two_steps, 1, args=(tiny_ckpt, request.param), timeout_s=240)
    return {"two": two, "one": one, "mode": request.param}


def test_recomputed_logprobs_equal_the_engines_bit_for_bit(runs: dict[str, Any]) -> None:
    """Before and after a sync, in LoRA and full mode, on 1 and 2 ranks: |diff| is exactly 0."""
    for result in (*runs["two"], *runs["one"]):
        for step in ("first", "second"):
            metrics = result[step]
            assert metrics["train_rollout_logprob_abs_diff"] == 0.0
            assert metrics["train_rollout_logprob_max_abs_diff"] == 0.0
            assert metrics["train_rollout_logprob_equal_frac"] == 1.0
            assert metrics["train_tokens"] == workers.N * workers.RESPONSE


def test_two_ranks_update_like_one(runs: dict[str, Any]) -> None:
    """HSDP over 2 ranks (and lora-core's DP mean) gives one rank's update, up to sum order."""
    two, one = runs["two"], runs["one"]
    assert two[0]["weights"].keys() == one[0]["weights"].keys()
    for name, value in one[0]["weights"].items():
        assert torch.equal(two[0]["weights"][name], two[1]["weights"][name]), name  # replicas
        # Sum order differs (fp32 reduce over ranks); Adam rescales near-zero gradients, so a
        # last-bit gradient difference can move a weight by a few 1e-6 after two steps.
        torch.testing.assert_close(two[0]["weights"][name], value, rtol=1e-4, atol=5e-5)
    for step in ("first", "second"):
        assert two[0][step]["grad_norm"] == pytest.approx(one[0][step]["grad_norm"], rel=1e-5)
        assert two[0][step]["loss"] == pytest.approx(one[0][step]["loss"], rel=1e-5, abs=1e-7)
    assert one[0]["second"]["grad_norm"] > 0.0


def test_lora_targets_follow_the_fused_sites(tiny_ckpt: str) -> None:
    from posttrain.models import load_pretrained

    model = load_pretrained(tiny_ckpt)
    targets, modules = lora_targets(model, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert modules == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert "layers.0.sites.qkv" in targets
    assert "layers.3.sites.proj" in targets
    assert next(n for n, _ in targets["layers.0.sites.qkv"].parts).endswith("q_proj")
    with pytest.raises(GrpoConfigError, match="share one fused weight with k_proj, v_proj"):
        lora_targets(model, ("q_proj",))
    with pytest.raises(GrpoConfigError, match="no_such match no linear"):
        lora_targets(model, ("q_proj", "k_proj", "v_proj", "no_such"))


def test_micro_batches() -> None:
    items = [object()] * 5
    assert [len(b) for b in micro_batches(items, 0)] == [5]  # type: ignore[arg-type]
    assert [len(b) for b in micro_batches(items, 2)] == [2, 2, 1]  # type: ignore[arg-type]


@pytest.mark.parametrize("train", ["lora", "full"])
def test_a_write_after_the_optimizer_exists_is_kept(tiny_ckpt: str, train: str) -> None:
    assert run_workers(workers.write_then_step, 2, args=(tiny_ckpt, train), timeout_s=120) == [
        True,
        True,
    ]


def test_per_layer_units_fast_and_checkpointed_update_like_one_rank(tiny_ckpt: str) -> None:
    """Per-layer FSDP units on 2 ranks with activation checkpointing, fast numerics (chunked
    token logprobs, SDPA, grouped experts) give the single-rank update; bf16 compute runs on
    the same units with fp32 masters and stays close to fp32."""
    fast = {"numerics": "fast", "fsdp_layer_min_params": 0}  # every (tiny) layer a unit
    one = run_workers(workers.per_layer_steps, 1, args=(tiny_ckpt, fast), timeout_s=240)
    two = run_workers(
        workers.per_layer_steps,
        2,
        args=(tiny_ckpt, {**fast, "activation_checkpointing": True}),
        timeout_s=240,
    )
    layers = [f"layers.{i}" for i in range(4)]
    assert two[0]["units"] == ["", *layers]  # the root, then one unit per decoder layer
    for name, value in one[0]["weights"].items():
        assert value.dtype == torch.float32, name  # fp32 masters
        assert torch.equal(two[0]["weights"][name], two[1]["weights"][name]), name
        torch.testing.assert_close(two[0]["weights"][name], value, rtol=1e-4, atol=5e-5)
    for a, b in zip(two[0]["steps"], one[0]["steps"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert one[0]["steps"][0]["train_rollout_logprob_max_abs_diff"] < 1e-4  # fast vs strict

    bf16 = run_workers(
        workers.per_layer_steps, 2, args=(tiny_ckpt, {**fast, "precision": "bf16"}), timeout_s=240
    )
    first = bf16[0]["steps"][0]
    assert 0.0 < first["train_rollout_logprob_max_abs_diff"] < 0.05  # bf16 compute, really
    assert first["loss"] == pytest.approx(one[0]["steps"][0]["loss"], abs=1e-2)
    for name, value in bf16[0]["weights"].items():
        assert value.dtype == torch.float32, name
        assert torch.equal(value, bf16[1]["weights"][name]), name


def test_small_layers_stay_in_the_root_unit_and_update_like_per_layer_units(tiny_ckpt: str) -> None:
    """Below ``fsdp_layer_min_params`` (the default's 1M; the tiny layers have ~10k) the layers
    stay in the root FSDP unit: strict numerics on 2 ranks then give the per-layer units'
    update (to fp32 rounding: the same gradients, reduced in another grouping), the same
    weights on both ranks, and the engine's logprobs bit for bit."""
    steps = workers.per_layer_steps
    root = run_workers(steps, 2, args=(tiny_ckpt, {}), timeout_s=240)
    per_layer = run_workers(steps, 2, args=(tiny_ckpt, {"fsdp_layer_min_params": 0}), timeout_s=240)
    assert root[0]["units"] == [""]
    assert per_layer[0]["units"] == ["", *(f"layers.{i}" for i in range(4))]
    # the samples' rollout logprobs are the checkpoint's: the first step's, the engine's bits
    assert root[0]["steps"][0]["train_rollout_logprob_max_abs_diff"] == 0.0
    for a, b in zip(root[0]["steps"], per_layer[0]["steps"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for name, value in per_layer[0]["weights"].items():
        assert torch.equal(root[0]["weights"][name], root[1]["weights"][name]), name
        torch.testing.assert_close(root[0]["weights"][name], value, rtol=1e-5, atol=1e-6)


def test_compiled_layers_under_fsdp_update_like_eager(
    tiny_ckpt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile=True`` compiles each FSDP2 layer unit's forward after sharding (hooks stay
    outside); two fast steps then give the eager update within fp32 tolerance, and the only
    graph break is the fp32 expert loop (the layers under FSDP2 trace whole otherwise). Backend
    ``aot_eager``: the real graph capture, no C++ code generation (minutes on 2 cores)."""
    monkeypatch.setenv("POSTTRAIN_COMPILE_BACKEND", "aot_eager")
    fast = {"numerics": "fast", "fsdp_layer_min_params": 0}  # every (tiny) layer a unit
    steps = workers.per_layer_steps
    eager = run_workers(steps, 1, args=(tiny_ckpt, fast), timeout_s=240)[0]
    compiled = run_workers(steps, 1, args=(tiny_ckpt, {**fast, "compile": True}), timeout_s=240)[0]
    assert not eager["compiled"]
    assert compiled["compiled"]
    # under FSDP2 the only break is the fp32 experts' per-expert loop, run eagerly on purpose
    assert compiled["graph_breaks"]
    assert all("torch.compiler.disable" in reason for reason in compiled["graph_breaks"])
    for a, b in zip(compiled["steps"], eager["steps"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for name, value in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], value, rtol=1e-4, atol=5e-5)
