"""Start N gloo ranks of ``lora_core_dist_worker.py`` as subprocesses and collect their JSON.

A rank that crashes or outlives ``timeout_s`` fails the run (with every rank's log tail); every
rank is stopped by its pid. Logs go to files, not pipes, so a chatty rank cannot block.
(Used until the interface's ``run_workers`` harness is on main.)
"""

from __future__ import annotations

import json
import os
import signal
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


def run_ranks(suite: str, world: int, *, timeout_s: float) -> list[dict[str, Any]]:
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONUNBUFFERED": "1",
        # megatron-core calls torch.compile at import; dynamo off saves seconds per rank
        "TORCHDYNAMO_DISABLE": "1",
    }
    with tempfile.TemporaryDirectory() as out:
        logs = [Path(out, f"rank{r}.log") for r in range(world)]
        procs = []
        for r in range(world):
            with open(logs[r], "w") as log:
                argv = [sys.executable, str(WORKER), suite, str(r), str(world), str(port), out]
                procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # one rank failed: the others would wait on it forever
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGUSR1)  # the worker dumps its stacks (faulthandler)
            time.sleep(0.5)
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tails = "\n".join(f"--- rank {r} ---\n{logs[r].read_text()[-3000:]}" for r in range(world))
        if any(p.returncode != 0 for p in procs):
            codes = [p.returncode for p in procs]
            raise AssertionError(
                f"suite {suite}: ranks exited {codes} (timeout {timeout_s}s)\n{tails}"
            )
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
