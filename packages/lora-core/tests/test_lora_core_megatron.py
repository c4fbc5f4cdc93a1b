"""TP=2 x DP=2 through megatron-core's real ``ColumnParallelLinear`` / ``RowParallelLinear`` on gloo.

``use_cpu_initialization=True``; for sequence parallelism the worker patches
``torch.cuda.current_device`` to return ``"cpu"`` (megatron-core allocates its all-gather buffer
on that device). Our own groups are passed to megatron (``tp_group=``) and to ``attach_lora``.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("megatron") is None:  # only the ranks import it (~20 s each)
    pytest.skip("megatron-core (extra 'megatron') is not installed", allow_module_level=True)
sys.path.insert(0, str(Path(__file__).parent))
import lora_core_dist_worker as worker

from posttrain.interface.testing import run_workers

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    # Import megatron-core once here, so the forked ranks inherit it instead of paying ~20 s of
    # CPU each. It calls torch.compile at import: dynamo is off only for that import.
    import torch._dynamo as dynamo

    saved = dynamo.config.disable
    dynamo.config.disable = True
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" x N
            warnings.simplefilter("ignore")
            import megatron.core.tensor_parallel  # noqa: F401
    finally:
        dynamo.config.disable = saved
    return run_workers(worker.suite_megatron, 4, timeout_s=400)


@pytest.mark.parametrize("mode", ["nosp", "sp"])
def test_megatron_layers_match_single_process(ranks: list[dict[str, Any]], mode: str) -> None:
    for rank, res in enumerate(ranks):
        r = res[mode]
        assert r["init_bitwise"] is True
        assert r["fwd_rel"] <= TOL, (rank, r["fwd_rel"])
        assert r["dx_rel"] <= TOL, (rank, r["dx_rel"])
        assert len(r["grad_rel"]) == 8
        assert max(r["grad_rel"].values()) <= TOL, (rank, r["grad_rel"])
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-6)


@pytest.mark.parametrize("mode", ["nosp", "sp"])
def test_megatron_param_tags(ranks: list[dict[str, Any]], mode: str) -> None:
    sp = mode == "sp"
    # (tensor_model_parallel, partition_dim, sequence_parallel)
    assert ranks[0][mode]["tags"] == {
        "0.fc1.lora_A": (False, -1, sp),
        "0.fc1.lora_B": (True, 0, False),
        "0.fc2.lora_A": (True, 1, False),
        "0.fc2.lora_B": (False, -1, sp),
    }
