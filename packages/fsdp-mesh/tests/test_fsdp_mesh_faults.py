"""Crashed and hung ranks fail fast; errors that need a live group name the numbers."""

from __future__ import annotations

from typing import Any

import fsdp_mesh_workers as workers
import pytest

from posttrain.fsdp_mesh import WorkerError, WorkerTimeoutError, launch_workers

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(90)
def test_hung_rank_fails_within_its_timeout() -> None:
    with pytest.raises(WorkerTimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 8 s"):
        launch_workers(workers.hang, 2, timeout_s=8, start_method="fork")


@pytest.mark.timeout(90)
def test_raising_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(WorkerError, match="rank 1 raised") as info:
        launch_workers(workers.crash, 2, timeout_s=60, start_method="fork")
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)


@pytest.mark.timeout(90)
def test_dying_rank_is_named_with_its_exit_code() -> None:
    with pytest.raises(WorkerError, match=r"rank 1 exited with code 7") as info:
        launch_workers(workers.hard_exit, 2, timeout_s=60, start_method="fork")
    assert info.value.rank == 1


@pytest.mark.timeout(280)
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
