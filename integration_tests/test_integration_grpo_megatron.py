"""``posttrain grpo`` with ``--backend megatron --tensor-model-parallel-size 2``: a real run.

The embedded recipe end to end (two local engines, ``--engines 2``, sgl-router, the session router), the
trainer on two gloo ranks that form one tensor-parallel group (attention heads and the dense
MLP split over megatron-core parallel linears), LoRA on every q/k/v/o linear, for a few
steps. The trainer's recomputed logprobs are no longer bit-identical to the engines' (the row
all-reduce adds two partial sums where the single-process kernel runs one tree): the run
reports that difference every step, and it stays small. With the experts split over two ranks
instead (``--expert-model-parallel-size 2``, full training), no sum is reordered and the
difference stays exactly 0 while full weights go to the engines every step.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from grpo_runs import records, run_grpo

if importlib.util.find_spec("megatron") is None:  # the grpo extra "megatron" (Linux)
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.timeout(900)]


def test_a_tensor_parallel_run_reports_its_train_rollout_difference(
    recipe_cache: Path, tmp_path: Path
) -> None:
    trainer = ("--backend", "megatron", "--tensor-model-parallel-size", "2")
    summary = run_grpo(recipe_cache, tmp_path, "--steps", "3", "--engines", "2", trainer=trainer)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["backend"], config["tensor_model_parallel_size"]) == ("megatron", 2)
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["train_tokens"] > 0
        assert r["grad_norm"] > 0.0
        # non-zero is expected (TP reorders a sum); a missed sync would be far larger
        assert 0.0 <= r["train_rollout_logprob_abs_diff"] < 1e-4, r
        assert r["train_rollout_logprob_max_abs_diff"] < 1e-3, r
    print(  # the numbers docs/megatron.md quotes (pytest -s shows them)
        "megatron tp2 train_rollout_logprob_abs_diff per step:",
        [r["train_rollout_logprob_abs_diff"] for r in steps],
        "max:",
        [r["train_rollout_logprob_max_abs_diff"] for r in steps],
        "equal_frac:",
        [r.get("train_rollout_logprob_equal_frac") for r in steps],
    )
    assert summary["train"] == "lora"
    adapter = tmp_path / "checkpoints" / "iter_0000002" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()


def test_expert_parallel_full_training_keeps_exact_parity(
    recipe_cache: Path, tmp_path: Path
) -> None:
    # EP splits no sum (each expert row computed alone, combined in the single-process order)
    # and the full weights reach the engines gathered bit for bit: the recompute is exact.
    trainer = ("--backend", "megatron", "--expert-model-parallel-size", "2")
    summary = run_grpo(
        recipe_cache, tmp_path, "--train", "full", "--steps", "2", "--engines", "2", trainer=trainer
    )
    steps = records(tmp_path)
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["train_rollout_logprob_max_abs_diff"] == 0.0 for r in steps), steps
    assert all(r["sync_bytes"] > 100_000 for r in steps)  # every weight, not an adapter
    assert summary["train_rollout_logprob_abs_diff_all_zero"] is True
    model = tmp_path / "checkpoints" / "iter_0000001" / "model"
    assert (model / "model.safetensors").is_file()
    assert (model / "config.json").is_file()
