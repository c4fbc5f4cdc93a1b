"""Test harness for every posttrain package: loopback servers and gloo worker ranks.

Import it from tests only (``from posttrain.interface.testing import ServerProcess``);
``import posttrain.interface`` does not load it.

- ``ServerProcess`` starts a server command, waits until a URL answers 200, and stops the
  process (and its process group) by pid; its log tail is in the error when it fails to start.
- ``AppServer`` serves an ASGI app with uvicorn from a thread of this process on a loopback
  port (a real socket and real HTTP, without a second torch import); it is ready once uvicorn
  has started. It needs uvicorn (imported when a server is built): the ``testing`` extra,
  ``pip install './packages/interface[testing]'``.
- ``free_port``, ``run_workers``, ``stop_process_group`` and ``wait_until_ready`` are the
  runtime helpers of ``posttrain.interface.processes`` (one implementation), re-exported so a test
  imports its whole harness from here. ``run_workers`` forks ranks from the already-warm test
  process by default, so a multi-process test does not pay torch's import once per rank; ranks
  with a ``backend`` need torch, which ``posttrain-interface`` does not require: the ``testing``
  extra brings it and uvicorn.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

from posttrain.interface._errors import ConfigError as _ConfigError
from posttrain.interface._errors import (
    ProcessError,
    ServerStartError,
    WorkerCrashedError,
    WorkerError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from posttrain.interface.processes import (
    free_port,
    run_workers,
    stop_process_group,
    wait_until_ready,
)

__all__ = [
    "AppServer",
    "ProcessError",
    "ServerProcess",
    "ServerStartError",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerFailedError",
    "WorkerTimeoutError",
    "free_port",
    "run_workers",
    "stop_process_group",
    "wait_until_ready",
]


def _sum_of_ranks(rank: int, world_size: int) -> float:
    """All-reduce each rank's ``rank + 1``: a smoke test of a process group (importable for spawn)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return float(value.item())


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
            raise _ConfigError("ServerProcess takes an argv list, not a shell string")
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
            raise ProcessError("ServerProcess has not been started")
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
        try:
            wait_until_ready(
                self.ready_url,
                timeout_s=self.timeout_s,
                process=self._process,
                poll_interval_s=self.poll_interval_s,
            )
        except ServerStartError as exc:
            self.stop()
            raise ServerStartError(
                f"server {self.argv[:3]}: {exc}; log tail:\n{self.log_tail()}"
            ) from None
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the server's process group, then SIGKILL after ``grace_s``."""
        if self._process is not None:
            stop_process_group(self._process, grace_s=grace_s)

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


class AppServer:
    """An ASGI app under uvicorn in a daemon thread, on 127.0.0.1 (port 0 picks a free one).

    Use as a context manager; ``url`` is known before it starts (the socket is bound at
    construction). ``uvicorn_options`` go to ``uvicorn.Config`` (``log_level`` defaults to
    ``"warning"``).
    """

    def __init__(
        self, app: Any, *, port: int = 0, timeout_s: float = 60.0, **uvicorn_options: Any
    ) -> None:
        import uvicorn

        self.timeout_s = timeout_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"log_level": "warning", "timeout_graceful_shutdown": 2, **uvicorn_options}
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self) -> Self:
        """Serve, and return once uvicorn has started (``ServerStartError`` otherwise)."""
        self._thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"the app server on {self.url} did not start within {self.timeout_s:g} s"
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for the thread, and close the socket."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
