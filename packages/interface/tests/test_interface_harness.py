"""The test harness: gloo ranks that fail cleanly, and loopback servers stopped by pid."""

from __future__ import annotations

import os
import sys
import time

import pytest

from posttrain.interface import ConfigError
from posttrain.interface.testing import (
    AppServer,
    ServerProcess,
    ServerStartError,
    WorkerCrashedError,
    WorkerFailedError,
    WorkerTimeoutError,
    _sum_of_ranks,
    free_port,
    run_workers,
)

pytestmark = pytest.mark.multiproc


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> list[float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(value)
    assert dist.get_world_size() == world_size
    return value.tolist()


def test_gloo_ranks_all_reduce() -> None:
    results = run_workers(_all_reduce_rank, 3, args=(2.0,), timeout_s=60)
    assert results == [[12.0], [12.0], [12.0]]


def _return_tensor(rank: int, world_size: int) -> object:
    import torch

    return torch.full((2,), float(rank))


def test_ranks_may_return_tensors() -> None:
    results = run_workers(_return_tensor, 2, timeout_s=60, backend=None)
    assert [r.tolist() for r in results] == [[0.0, 0.0], [1.0, 1.0]]


def test_spawned_ranks_work_too() -> None:
    # Spawned ranks unpickle ``fn`` by module name, so it must live in an importable module.
    results = run_workers(_sum_of_ranks, 2, timeout_s=90, start_method="spawn")
    assert results == [3.0, 3.0]


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_hung_rank_fails_within_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(
        WorkerTimeoutError, match=r"ranks \[1\] of 2 did not finish within 3 s"
    ) as e:
        run_workers(_hang_on_rank_one, 2, timeout_s=3, backend=None)
    # The hang is cut at the harness timeout, not at pytest's (300 s).
    assert time.monotonic() - start < 30
    # ...and the message says where the rank hung: its stack, down to the sleeping line
    message = str(e.value)
    assert "rank 1's Python stacks when it was killed" in message
    assert "in _hang_on_rank_one" in message
    assert "rank 0's" not in message


def test_a_fork_from_a_process_with_a_live_store_is_named_in_the_timeout() -> None:
    dist = pytest.importorskip("torch.distributed")
    # a store left serving in this process (as an in-process run's default group can leave one)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    try:
        with pytest.raises(WorkerTimeoutError) as e:
            run_workers(_hang_on_rank_one, 2, timeout_s=3, backend=None)
    finally:
        del store
    assert "forked from a process with torch.distributed threads running (pt_tcpstore" in str(
        e.value
    )
    with pytest.raises(WorkerTimeoutError) as e:  # the store gone: nothing to name
        run_workers(_hang_on_rank_one, 2, timeout_s=3, backend=None)
    assert "torch.distributed threads" not in str(e.value)


def _hang_in_collective(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(3600)


def test_rank_stuck_in_collective_is_killed() -> None:
    with pytest.raises(WorkerTimeoutError, match="did not finish") as e:
        run_workers(_hang_in_collective, 2, timeout_s=4)
    # both ranks hung (rank 0 in the collective, a C call): both stacks are in the message
    assert str(e.value).count("in _hang_in_collective") == 2


def _crash_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    time.sleep(3600)
    return rank


def test_crashed_rank_is_named() -> None:
    with pytest.raises(WorkerCrashedError, match="rank 0 of 2 exited with code 3"):
        run_workers(_crash_rank_zero, 2, timeout_s=30, backend=None)


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


def test_raising_rank_reports_its_traceback() -> None:
    with pytest.raises(WorkerFailedError, match=r"(?s)rank 1 of 2 raised:.*boom on purpose"):
        run_workers(_raise_on_rank_one, 2, timeout_s=30, backend=None)


def _raise_while_peer_waits(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 then fails too, after rank 1: the cause named is rank 1


def test_first_failing_rank_is_named_not_the_peers_it_broke() -> None:
    with pytest.raises(WorkerFailedError, match="rank 1 of 2 raised") as info:
        run_workers(_raise_while_peer_waits, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)


def _exit_while_peer_waits(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        os._exit(7)
    dist.barrier()  # rank 0 raises "connection closed by peer" and reports it


def test_rank_that_died_silently_is_named_before_the_peer_that_raised() -> None:
    with pytest.raises(WorkerCrashedError, match="rank 1 of 2 exited with code 7") as info:
        run_workers(_exit_while_peer_waits, 2, timeout_s=60)
    assert info.value.rank == 1


def test_bad_launch_options_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ConfigError, match=r"world_size must be at least 1, got 0"):
        run_workers(print, 0, timeout_s=1)
    with pytest.raises(ConfigError, match=r"backend must be 'gloo', 'nccl' or None, got 'mpi'"):
        run_workers(print, 1, timeout_s=1, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"timeout_s must be positive, got 0"):
        run_workers(print, 1, timeout_s=0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_server_process_ready_and_stopped_by_pid(tmp_path: os.PathLike[str]) -> None:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp_path),
    ]
    with ServerProcess(argv, f"http://127.0.0.1:{port}/", timeout_s=30) as server:
        pid = server.pid
        assert _pid_alive(pid)
    assert not _pid_alive(pid)


def test_server_that_exits_reports_its_log() -> None:
    argv = [sys.executable, "-c", "import sys; print('bad flag --nope'); sys.exit(2)"]
    with pytest.raises(ServerStartError, match=r"(?s)exited with code 2.*bad flag --nope"):
        ServerProcess(argv, f"http://127.0.0.1:{free_port()}/", timeout_s=10).start()


def test_server_never_ready_is_stopped() -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(3600)"]
    server = ServerProcess(argv, f"http://127.0.0.1:{free_port()}/", timeout_s=1)
    with pytest.raises(ServerStartError, match="was not ready within 1 s"):
        server.start()
    assert not _pid_alive(server.pid)


async def _hello(scope: dict[str, object], receive: object, send: object) -> None:
    """A bare ASGI app (no framework): 200 "hello" on every HTTP request."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"hello"})  # type: ignore[operator]


def test_app_server_serves_from_a_thread_and_stops() -> None:
    import urllib.error
    import urllib.request

    with (
        AppServer(_hello) as server,
        urllib.request.urlopen(f"{server.url}/anything", timeout=10) as reply,
    ):
        assert (reply.status, reply.read()) == (200, b"hello")
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    from posttrain.interface.processes import free_ports

    ports = free_ports(16)
    assert len(set(ports)) == 16
    with socket.socket() as sock:  # each was released: binding one now works
        sock.bind(("127.0.0.1", ports[0]))
    assert free_ports(0) == ()
    with pytest.raises(ConfigError, match="count"):
        free_ports(-1)
