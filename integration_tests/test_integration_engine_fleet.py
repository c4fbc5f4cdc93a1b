"""grpo's ``EngineFleet`` against two real local engines: the update group is formed once for a
run and kept across syncs, formed again without an engine that is lost and with it once it is
re-admitted, and destroyed at ``close``; every request to an engine goes through its one client.

The trainer runs in ``fleet_worker`` (a spawned rank). A recording transport (httpx's real one
underneath) counts the weight-group routes each engine is sent. After every sync both live
engines serve exactly the trainer's weights (checksum) at the trainer's version.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_worker import fleet_run

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


def test_one_group_per_run_formed_again_when_its_members_change(
    checkpoint: Path, engines: tuple[str, str]
) -> None:
    a, b = engines
    # spawned, not forked: an earlier test's in-process run can leave gloo's and the default
    # group's TCPStore threads alive in pytest's process, and a rank forked from there hung in
    # CI (three full runs)
    (out,) = run_workers(fleet_run, 1, args=(str(checkpoint), a, b), timeout_s=240,
                         start_method="spawn")  # fmt: skip
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
