"""Multi-rank gloo checks against single-process references, W = 2 and 4, every r dividing W.

The groups run once per session (``w4``/``w2`` fixtures in conftest); each test reads its part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsdp_mesh_workers as workers
import pytest

from posttrain.interface.testing import run_workers

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(280)]


def _assert_parity(out: list[dict[str, Any]]) -> None:
    world = len(out)
    layouts = out[0]["layouts"]
    for rank, rank_out in enumerate(out):
        for (r, method), rep in zip(layouts, rank_out["parity"], strict=True):
            assert rep["rank"] == rank
            assert (rep["replicate"], rep["shard"]) == (r, world // r)
            assert rep["failures"] == [], rep["failures"]
            assert rep["notes"] == []
            assert rep["passed"] is True
            assert rep["checkpoint_exact"] is True
            assert rep["max_grad_err"] <= 2e-6
            assert rep["method"] == ("unflatten" if method == "auto" else method)
            # Deferred accumulation: one replicate all-reduce per FSDP group per step.
            groups = rep["fsdp_groups"]
            assert groups == 4
            assert rep["replicate_all_reduces"] == (groups if r > 1 else 0)
            assert len(rep["step_seconds"]) == 2  # step 0 is counted, not timed
            assert len(rep["grad_norms"]) == 3
    # The clipped norm is the same float on every rank.
    for i in range(len(layouts)):
        assert len({tuple(rank_out["parity"][i]["grad_norms"]) for rank_out in out}) == 1


def test_w4_every_layout_matches_single_process_reference(w4: list[dict[str, Any]]) -> None:
    assert [tuple(x) for x in w4[0]["layouts"]] == [
        (1, "auto"),
        (2, "auto"),
        (4, "auto"),
        (2, "init_device_mesh"),
    ]
    _assert_parity(w4)


def test_uneven_shards_are_covered(w4: list[dict[str, Any]]) -> None:
    # r=1, s=4: 30 rows shard as 8, 8, 8, 6 and the 3-row head as 1, 1, 1, 0.
    rows = [rank_out["parity"][0]["local_rows"] for rank_out in w4]
    assert [r["blocks.0.0.weight"] for r in rows] == [8, 8, 8, 6]
    assert [r["head.weight"] for r in rows] == [1, 1, 1, 0]
    # r=2, s=2: 15 + 15, and the head 2 + 1, the same in both replicas.
    rows = [rank_out["parity"][1]["local_rows"] for rank_out in w4]
    assert [r["head.weight"] for r in rows] == [2, 1, 2, 1]


def test_w2_every_layout_matches_single_process_reference(w2: list[dict[str, Any]]) -> None:
    _assert_parity(w2)


def test_checkpoint_reloads_bit_exactly_under_other_layouts(
    w4: list[dict[str, Any]], ckpt_root: Path
) -> None:
    for rank_out in w4:
        ckpt = rank_out["checkpoint"]
        assert ckpt["exact"] == {1: True, 4: True, 2: True}
        assert ckpt["meta"] == (2, 4, 2, 2, {"note": "x"})
    files = w4[0]["checkpoint"]["files"]
    assert "iter_0000002" in files
    assert not any(name.endswith(".tmp") for name in files)
    assert (ckpt_root / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    step_files = w4[0]["checkpoint"]["step_files"]  # write_files' files joined the commit
    assert {f"note_rank{r}.txt" for r in range(4)} <= set(step_files)
    assert "meta.json" in step_files


@pytest.mark.timeout(120)
def test_files_checkpoint_commits_all_or_nothing(tmp_path: Path) -> None:
    out = run_workers(
        workers.files_checkpoint_commit_or_nothing, 2, args=(str(tmp_path),), timeout_s=90
    )
    for rank_out in out:
        assert rank_out["error"] == "disk full"
        assert rank_out["latest"] == 1  # the failed step 2 never became current
        assert rank_out["meta"] == (1, {"k": 1})
        assert rank_out["step1"] == ["manifest.json", "meta.json", "part0.bin", "part1.bin"]
        assert rank_out["step2_committed"] is False


def test_checkpoint_from_w4_reloads_bit_exactly_at_w2(w2: list[dict[str, Any]]) -> None:
    for rank_out in w2:
        assert rank_out["checkpoint"]["exact"] == {1: True, 2: True}


@pytest.mark.parametrize(("world", "replicate"), [(4, 2), (4, 4), (2, 2)])
def test_deferred_all_reduce_same_gradients_fewer_calls(
    w4: list[dict[str, Any]], w2: list[dict[str, Any]], world: int, replicate: int
) -> None:
    micro = 4
    for rank_out in w4 if world == 4 else w2:
        res = rank_out["deferred"][replicate]
        eager, deferred = res["counts"][False], res["counts"][True]
        groups = eager["groups"]
        assert eager["replicate_all_reduce"] == groups * micro
        assert deferred["replicate_all_reduce"] == groups
        assert eager["replicate_bytes"] == micro * deferred["replicate_bytes"] > 0
        assert eager["shard_reduce_scatter"] == deferred["shard_reduce_scatter"]
        assert res["max_diff"] <= 1e-6


def test_precision_offload_and_reshard_variants(w2: list[dict[str, Any]]) -> None:
    for rank_out in w2:
        v = rank_out["variants"]
        # bf16 compute with fp32 reduction: the same weights whatever the layout.
        assert v["bf16_r1_vs_rW"] == 0.0
        # CPU offload (a no-op placement on a CPU mesh) and keeping params unsharded after forward
        # change nothing numerically.
        assert v["offload_vs_fp32"] == 0.0
        assert v["keep_vs_fp32"] <= 1e-6
        # bf16 compute really ran (differs from fp32) and stays within bf16 precision.
        assert 0.0 < v["bf16_vs_fp32"] < 0.1


def test_ignored_params_stay_plain_and_unreduced(w2: list[dict[str, Any]]) -> None:
    for rank_out in w2:
        assert rank_out["ignored"] == {
            "ignored_is_plain": True,
            "others_sharded": True,
            "ignored_grad_is_local": True,
        }


def test_live_group_errors_fallback_clip_and_export(w2: list[dict[str, Any]]) -> None:
    out = [rank_out["live"] for rank_out in w2]
    for rank, res in enumerate(out):
        assert res["world_mismatch"] == (
            "MeshBuildError: spec world_size=4 but the process group has 2 ranks"
        )
        assert res["grid_mismatch"].startswith(f"MeshBuildError: rank {rank}: HSDP mesh grid")
        assert "does not cover all 2 ranks exactly once" in res["truncated_world"]
        # Fallback (second root mesh) and unflatten give the same layout.
        fb, uf = res["fallback"], res["unflatten"]
        assert fb["method"] == "init_device_mesh"
        assert uf["method"] == "unflatten"
        for key in ("coords", "shard_group", "replicate_group", "sharding_mesh_ndim"):
            assert fb[key] == uf[key]
        auto = res["auto_without_unflatten"]
        assert auto["method"] == "init_device_mesh"
        assert auto["replicate_group"] == [0, 1]
        assert auto["shard_group"] == [rank]
        assert "has no DeviceMesh._unflatten; use method='auto'" in res["forced_without_unflatten"]
        assert fb["replicate_group"] == [0, 1]
        assert fb["shard_group"] == [rank]
        assert res["early_exit"] == (
            "AccumulationError: left gradient accumulation after 1 of 2 micro-batches: "
            "the replicate all-reduce never ran"
        )
        assert res["too_many"] == (
            "AccumulationError: micro-batch 2 exceeds the declared num_micro_batches=1"
        )
        assert res["outside"].startswith("AccumulationError: micro_batch() used outside")
        ours, ref = res["inf_norm"]
        assert ours == pytest.approx(ref, rel=1e-6)
        ours, ref = res["noop_clip"]
        assert ours == pytest.approx(ref, rel=1e-5)
        assert res["noop_grads_equal"] is True
        assert res["export_equal"] is True
        assert res["export_dtype"] == "torch.float64"


@pytest.mark.parametrize("suite", ["w2", "w4"])
def test_full_state_dict_gathers_in_buckets_with_the_same_bytes(
    suite: str, request: pytest.FixtureRequest
) -> None:
    """Consecutive dim-0-sharded weights go as one all-gather per bucket (flat and HSDP mesh,
    uneven and empty shards at W=4); names, order and bytes equal one gather per tensor."""
    out = request.getfixturevalue(suite)
    for rank_out in out:
        res = rank_out["export"]
        for layout, replicate in (("r1", 1), ("r2", 2)):
            runs = res[layout]
            for run in runs.values():
                assert run["names_equal"]
                assert run["bytes_equal"]
            # a shard group of one rank (W=2, r=2) holds whole tensors: nothing to gather
            want = [3, 2, 1] if len(out) // replicate > 1 else [0, 0, 0]
            assert [runs[k]["gathers"] for k in ("one_each", "small", "default")] == want
        assert res["zero_bucket"] == "bucket_bytes must be at least 1, got 0"
