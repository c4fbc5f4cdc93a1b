"""Start N gloo ranks of ``lora_core_dist_worker.py`` as subprocesses and collect their JSON.

A rank that crashes or outlives ``timeout_s`` fails the run; every rank is stopped by its pid.
(Used until the interface's ``run_workers`` harness is on main.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("lora_core_dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    suite: str, world: int, *, timeout_s: float, extra_env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), suite, str(r), str(world), str(port), out],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        logs: list[str] = []
        try:
            for p in procs:
                left = max(0.1, deadline - time.monotonic())
                try:
                    logs.append(p.communicate(timeout=left)[0])
                except subprocess.TimeoutExpired as exc:
                    raise AssertionError(
                        f"suite {suite}: rank {procs.index(p)} hung past {timeout_s}s"
                    ) from exc
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise AssertionError(
                    f"suite {suite}: rank {r} exited {p.returncode}:\n{logs[r][-4000:] if r < len(logs) else ''}"
                )
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
