"""grpo's ``EngineFleet`` against two real local engines: the update group is formed once for a
run and kept across syncs, formed again without an engine that is lost and with it once it is
re-admitted, and destroyed at ``close``; every request to an engine goes through its one client.

A recording transport (httpx's real one underneath) counts the weight-group routes each engine
is sent. After every sync both live engines serve exactly the trainer's weights (checksum) at
the trainer's version.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
def engines(checkpoint: Path) -> Iterator[tuple[str, str]]:
    urls, procs = [], []
    for _ in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "posttrain.local_engine", "--model-path", str(checkpoint),
                "--port", str(port), "--num-threads", "1"]  # fmt: skip
        procs.append(ServerProcess(argv, f"http://127.0.0.1:{port}/health", timeout_s=120))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for proc in procs:
            proc.start()
        yield urls[0], urls[1]
    finally:
        for proc in procs:
            proc.stop()


class Recording(httpx.BaseTransport):
    """httpx's own transport, noting each weight-group request as ``(engine, route)``."""

    ROUTES = ("/init_weights_update_group", "/destroy_weights_update_group")

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in self.ROUTES:
            self.seen.append((f"http://{request.url.host}:{request.url.port}", request.url.path))
        return self.inner.handle_request(request)

    def take(self) -> list[tuple[str, str]]:
        seen, self.seen = sorted(self.seen), []
        return seen


def _fleet_run(rank: int, world: int, ckpt: str, a: str, b: str) -> dict[str, Any]:
    import torch

    from posttrain.formats import tensors_sha256
    from posttrain.fsdp_mesh import iter_full_state_dict
    from posttrain.grpo.config import GrpoConfig
    from posttrain.grpo.fleet import EngineFleet, SyncTarget
    from posttrain.grpo.trainer import build_policy
    from posttrain.models import to_hf_state_dict

    torch.set_num_threads(1)
    policy = build_policy(GrpoConfig(model_path=Path(ckpt), train="full", replicate=1, shard=1))
    wire = Recording()
    target = SyncTarget(engine_urls=(a, b), timeout_s=60.0, transport=wire)
    out: dict[str, Any] = {}

    def step(name: str, version: int) -> None:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(0.01)
        synced = fleet.sync(policy, version, when=name)
        sha = tensors_sha256(
            to_hf_state_dict(dict(iter_full_state_dict(policy.model)), policy.model.config)
        )
        served = {url: httpx.get(f"{url}/weights_checksum", timeout=30).json() for url in (a, b)}
        out[name] = {
            "routes": wire.take(), "live": fleet.engine_urls, "lost": fleet.lost,
            "readmitted": synced.readmitted, "sha": sha, "versions": dict(fleet.versions),
            "served": {u: (s["weight_version"], s["sha256"]) for u, s in served.items()},
        }  # fmt: skip

    with EngineFleet(target) as fleet:
        first = fleet.first_version()
        step("first", first)
        step("second", first + 1)
        fleet._set_aside(((b, "set aside by the test"),), "test")  # as if b had not answered
        fleet.readmit_lost = False  # not probed: it stays out
        step("without-b", first + 2)
        fleet.readmit_lost = True
        step("readmit-b", first + 3)  # b answers /health: re-admitted
    out["close"] = wire.take()
    out["first_version"] = first
    return out


def test_one_group_per_run_formed_again_when_its_members_change(
    checkpoint: Path, engines: tuple[str, str]
) -> None:
    a, b = engines
    (out,) = run_workers(_fleet_run, 1, args=(str(checkpoint), a, b), timeout_s=240)
    v = out["first_version"]
    init, destroy = "/init_weights_update_group", "/destroy_weights_update_group"
    assert out["first"]["routes"] == sorted([(a, init), (b, init)])
    assert out["second"]["routes"] == []  # the same group: nothing formed, nothing destroyed
    # b left out: the old group destroyed on a only, a new one formed with a
    assert out["without-b"]["routes"] == sorted([(a, destroy), (a, init)])
    assert out["without-b"]["live"] == (a,)
    assert out["without-b"]["served"][b][0] == v + 1  # b was not pushed to
    # b re-admitted: a group formed anew with both (b first leaves the one it held)
    assert out["readmit-b"]["readmitted"] == (b,)
    assert out["readmit-b"]["routes"] == sorted([(a, destroy), (b, destroy), (a, init), (b, init)])
    assert (out["readmit-b"]["live"], out["readmit-b"]["lost"]) == ((a, b), ())
    assert out["close"] == sorted([(a, destroy), (b, destroy)])
    for name, k in (("first", 0), ("second", 1), ("readmit-b", 3)):
        record = out[name]
        assert record["served"] == {a: (v + k, record["sha"]), b: (v + k, record["sha"])}
        assert record["versions"] == {a: v + k, b: v + k}
    assert out["without-b"]["served"][a] == (v + 2, out["without-b"]["sha"])
