"""grpo's disk syncs against a real local engine: ``weight_sync="disk"`` writes the update as a
checkpoint in ``sync_dir`` and posts SGLang's ``/update_weights_from_disk`` with the version;
``lora_sync="disk"`` writes the adapter as a PEFT directory and posts ``/load_lora_adapter``.
The engine then serves exactly the trainer's weights (checksum) at the trainer's version, and
the adapter under its name."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from posttrain.interface.processes import run_workers
from posttrain.interface.testing import ServerProcess, free_port
from posttrain.models.__main__ import init_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=3, max_positions=64)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(checkpoint),
            "--port", str(port), "--enable-lora"]  # fmt: skip
    with ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=120):
        yield f"http://127.0.0.1:{port}"


def _sync_over_disk(rank: int, world: int, ckpt: str, url: str, sync_dir: str) -> dict[str, object]:
    import torch

    from posttrain.formats import tensors_sha256
    from posttrain.fsdp_mesh import iter_full_state_dict
    from posttrain.grpo.config import GrpoConfig
    from posttrain.grpo.fleet import EngineFleet, SyncTarget
    from posttrain.grpo.trainer import build_policy
    from posttrain.models import to_hf_state_dict

    torch.set_num_threads(1)
    target = SyncTarget(
        engine_urls=(url,), weight_sync="disk", lora_sync="disk", sync_dir=sync_dir,
        base_model_path=ckpt, timeout_s=60.0,
    )  # fmt: skip
    full = build_policy(GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=1))
    with torch.no_grad():
        for p in full.model.parameters():
            p.add_(0.01)
    with EngineFleet(target) as fleet:
        fleet.sync(full, 5, first=True)
    gathered = dict(iter_full_state_dict(full.model))
    expected = tensors_sha256(to_hf_state_dict(gathered, full.model.config))
    lora = build_policy(GrpoConfig(model_path=Path(ckpt), train="lora", replicate=1, shard=1))
    with EngineFleet(target) as fleet:
        fleet.sync(lora, 6, first=True)
    return {"expected_sha": expected}


def test_disk_syncs_install_the_trainers_weights_and_adapter(
    checkpoint: Path, engine: str, tmp_path: Path
) -> None:
    (out,) = run_workers(
        _sync_over_disk, 1, args=(str(checkpoint), engine, str(tmp_path / "sync")), timeout_s=240
    )
    state = httpx.get(f"{engine}/weights_checksum", timeout=30).json()
    assert state["weight_version"] == 5
    assert state["sha256"] == out["expected_sha"]
    info = httpx.get(f"{engine}/server_info", timeout=30).json()
    assert "policy" in info["loaded_adapters"]
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["adapter-v6", "weights-v5"]
