"""Test harness for every posttrain package: gloo worker ranks and loopback servers.

Import it from tests only (``from posttrain.interface.testing import run_workers``);
``import posttrain.interface`` does not load it, and it imports torch only
inside worker processes.

- ``run_workers`` starts N ranks, each with a gloo (or NCCL) process group,
  runs ``fn(rank, world_size, *args)`` in each and returns the per-rank
  results. Ranks are forked from the already-warm test process by default, so
  a multi-process test does not pay torch's import once per rank; pass
  ``start_method="spawn"`` for code that must not inherit the parent. A rank
  that hangs past ``timeout_s``, crashes or raises fails the call with an
  error naming the rank, and every rank is killed: a hung rank fails the test,
  never CI.
- ``ServerProcess`` starts a server command, waits until a URL answers 200,
  and stops the process (and its process group) by pid.
- ``free_port`` finds a free TCP port on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue as queue_module
import signal
import socket
import subprocess
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Self

from posttrain.interface._errors import PosttrainError

__all__ = [
    "HarnessError",
    "ServerProcess",
    "ServerStartError",
    "WorkerCrashedError",
    "WorkerFailedError",
    "WorkerTimeoutError",
    "free_port",
    "run_workers",
]


class HarnessError(PosttrainError):
    """A test-harness process did not behave: it hung, crashed, raised or never became ready."""


class WorkerTimeoutError(HarnessError):
    """Some ranks did not finish within the timeout (they were killed)."""


class WorkerCrashedError(HarnessError):
    """A rank exited with a non-zero code or a signal without reporting a result."""


class WorkerFailedError(HarnessError):
    """A rank raised; the message carries its traceback."""


class ServerStartError(HarnessError):
    """A server process exited or did not become ready in time; the message has its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: Sequence[Any],
    results: Any,
    threads_per_rank: int,
    pg_timeout_s: float,
) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads_per_rank)
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        try:
            value = fn(rank, world_size, *args)
        finally:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)


def _sum_of_ranks(rank: int, world_size: int) -> float:
    """All-reduce each rank's ``rank + 1``: a smoke test of a process group (importable for spawn)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return float(value.item())


def _kill_all(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    backend: str | None = "gloo",
    start_method: str = "fork",
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    With ``backend=None`` no process group is created. Results must be
    picklable. Raises ``WorkerTimeoutError``, ``WorkerCrashedError`` or
    ``WorkerFailedError`` (naming the rank) after killing every rank.
    """
    if world_size < 1:
        raise HarnessError(f"world_size must be >= 1, got {world_size}")
    if start_method == "fork":
        # Warm up once here so that forked ranks inherit torch instead of importing it each.
        import torch.distributed  # noqa: F401

    context: Any = multiprocessing.get_context(start_method)
    results: Any = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_worker_main,
            args=(
                fn,
                rank,
                world_size,
                port,
                backend,
                tuple(args),
                results,
                threads_per_rank,
                timeout_s,
            ),
            name=f"posttrain-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise WorkerTimeoutError(
                    f"rank(s) {missing} of {world_size} did not finish within {timeout_s:g} s "
                    "(killed)"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.1))
            except queue_module.Empty:
                now = time.monotonic()
                for rank, process in enumerate(processes):
                    if rank in collected or process.is_alive():
                        continue
                    code = process.exitcode
                    # A clean exit may still have its result in flight through the queue.
                    exited_at.setdefault(rank, now)
                    if (code is not None and code != 0 and now - exited_at[rank] > 1.0) or (
                        now - exited_at[rank] > 5.0
                    ):
                        how = f"signal {-code}" if code is not None and code < 0 else f"code {code}"
                        raise WorkerCrashedError(
                            f"rank {rank} of {world_size} exited with {how} without a result"
                        ) from None
                continue
            if not ok:
                raise WorkerFailedError(f"rank {rank} of {world_size} raised:\n{payload}")
            collected[rank] = payload
    finally:
        if len(collected) < world_size:
            _kill_all(processes)
        else:
            for process in processes:
                process.join(timeout=10)
            _kill_all(processes)
        results.close()
        results.join_thread()
    return [collected[rank] for rank in range(world_size)]


class ServerProcess:
    """A server subprocess, ready once ``ready_url`` answers HTTP 200, stopped by its pid.

    Use as a context manager. Output goes to a log file whose tail is shown
    when the server fails to start.
    """

    def __init__(
        self,
        argv: Sequence[str],
        ready_url: str,
        *,
        timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        poll_interval_s: float = 0.1,
    ) -> None:
        if isinstance(argv, str):
            raise HarnessError("ServerProcess takes an argv list, not a shell string")
        self.argv = list(argv)
        self.ready_url = ready_url
        self.timeout_s = timeout_s
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.poll_interval_s = poll_interval_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="posttrain-server-", suffix=".log")  # noqa: SIM115

    @property
    def pid(self) -> int:
        if self._process is None:
            raise HarnessError("ServerProcess has not been started")
        return self._process.pid

    @property
    def log_path(self) -> str:
        return self._log.name

    def log_tail(self, max_bytes: int = 4000) -> str:
        with open(self._log.name, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            return handle.read().decode("utf-8", "replace")

    def start(self) -> Self:
        self._process = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                raise ServerStartError(
                    f"server {self.argv[:3]} exited with code {code} before {self.ready_url} was "
                    f"ready; log tail:\n{self.log_tail()}"
                )
            if _answers_ok(self.ready_url):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"server {self.argv[:3]} was not ready at {self.ready_url} within "
                    f"{self.timeout_s:g} s; log tail:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval_s)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the server's process group, then SIGKILL after ``grace_s``."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=grace_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._log.close()


def _answers_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False
