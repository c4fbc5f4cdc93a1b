"""LocalRunner on real processes: stages, readiness, prefixed logs, stop by pid, no orphans."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from posttrain.interface.testing import free_port
from posttrain.launch import (
    LocalRunner,
    Plan,
    ProcessFailedError,
    ProcessSpec,
    Readiness,
    ReadinessError,
    Role,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]

SERVER = str(Path(__file__).parent / "serve_health.py")


def server(name: str, port: int, stage: int, *extra: str, timeout_s: float = 20.0) -> ProcessSpec:
    return ProcessSpec(
        name=name,
        role=Role.ENGINE,
        argv=("python", SERVER, str(port), *extra),
        stage=stage,
        readiness=Readiness(url=f"http://{{node_ip}}:{port}/health", timeout_s=timeout_s),
    )


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def tree(pid: int) -> list[int]:
    proc = psutil.Process(pid)
    return [pid, *(c.pid for c in proc.children(recursive=True))]


class Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def __call__(self, name: str, line: str) -> None:
        self.lines.append((name, line))

    def index(self, name: str, needle: str) -> int:
        return next(i for i, (n, line) in enumerate(self.lines) if n == name and needle in line)


def test_stages_readiness_prefixed_logs_and_full_stop() -> None:
    p0, p1, p2 = free_port(), free_port(), free_port()
    plan = Plan(
        name="t",
        hardware="local",
        nodes=1,
        processes=(
            server("engine-0", p0, 0, "--spawn-child", "--delay", "0.5"),
            server("engine-1", p1, 0),
            server("router", p2, 1),
        ),
    )
    sink = Sink()
    runner = LocalRunner(plan, sink=sink, poll_s=0.05)
    with runner:
        runner.start()
        assert runner.urls == {
            "engine-0": f"http://127.0.0.1:{p0}",
            "engine-1": f"http://127.0.0.1:{p1}",
            "router": f"http://127.0.0.1:{p2}",
        }
        pids = [pid for rp in runner.running for pid in tree(rp.pid)]
        assert len(pids) == 4  # three servers and the sleep grandchild
        # Both stage-0 processes were spawned before either was awaited; stage 1 after both.
        assert sink.index("launcher", "started engine-1") < sink.index("launcher", "engine-0 ready")
        assert sink.index("launcher", "engine-1 ready") < sink.index("launcher", "started router")
        runner.wait(timeout_s=0.3)  # everything healthy: returns at the timeout
    assert all(gone(pid) for pid in pids)
    assert ("engine-0", f"listening on {p0}") in sink.lines  # prefixed by the process name
    assert any(n == "engine-0" and line.startswith("spawned child") for n, line in sink.lines)


def test_process_dying_before_ready_names_it_and_stops_the_rest() -> None:
    port = free_port()
    dying = ProcessSpec(
        name="engine-1",
        role=Role.ENGINE,
        argv=("python", "-c", "import sys; print('cannot load'); sys.exit(3)"),
        readiness=Readiness(url=f"http://{{node_ip}}:{free_port()}/health", timeout_s=20),
    )
    plan = Plan(name="t", hardware="local", nodes=1, processes=(server("engine-0", port, 0), dying))
    sink = Sink()
    runner = LocalRunner(plan, sink=sink, poll_s=0.05)
    with pytest.raises(ProcessFailedError, match=r"engine-1 .*exited with code 3") as info:
        runner.start()
    assert info.value.returncode == 3
    assert all(gone(rp.pid) for rp in runner.running)
    assert ("engine-1", "cannot load") in sink.lines


def test_readiness_timeout_names_process_and_url() -> None:
    port = free_port()
    plan = Plan(
        name="t",
        hardware="local",
        nodes=1,
        processes=(server("engine-0", port, 0, "--delay", "60", timeout_s=1.0),),
    )
    runner = LocalRunner(plan, sink=Sink(), poll_s=0.05)
    with pytest.raises(ReadinessError, match=rf"engine-0 .*127.0.0.1:{port}/health.*HTTP 503"):
        runner.start()
    assert all(gone(rp.pid) for rp in runner.running)


def test_wait_raises_when_a_server_dies_later() -> None:
    port = free_port()
    plan = Plan(name="t", hardware="local", nodes=1, processes=(server("engine-0", port, 0),))
    with LocalRunner(plan, sink=Sink(), poll_s=0.05) as runner:
        runner.start()
        os.kill(runner.running[0].pid, signal.SIGKILL)
        with pytest.raises(ProcessFailedError, match="engine-0"):
            runner.wait(timeout_s=10)


def _ignore_sigint() -> None:  # runs in the child before exec: SIG_IGN survives exec
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_cli(
    tmp_path: Path, *servers: ProcessSpec, sigint_ignored: bool = False
) -> tuple[subprocess.Popen[str], list[int]]:
    plan = Plan(name="t", hardware="local", nodes=1, processes=servers)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    cli = subprocess.Popen(
        [sys.executable, "-m", "posttrain.launch", "run", str(path), "--runner", "local"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
    )
    assert cli.stdout is not None
    deadline = time.monotonic() + 40
    ready = 0
    while ready < len(servers) and time.monotonic() < deadline:
        line = cli.stdout.readline()
        assert line, "posttrain run exited before its processes were ready"
        ready += " ready at " in line
    assert ready == len(servers)
    return cli, tree(cli.pid)[1:]


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["plain", "sigint-inherited-ignored"])
def test_ctrl_c_on_the_cli_stops_every_process(tmp_path: Path, sigint_ignored: bool) -> None:
    # Also when the CLI inherits SIGINT ignored (nohup, a background job, a parent inside C
    # system()): Python keeps an inherited SIG_IGN, so the CLI must take Ctrl-C back itself.
    cli, pids = _run_cli(
        tmp_path, server("engine-0", free_port(), 0, "--spawn-child"), server("r", free_port(), 1),
        sigint_ignored=sigint_ignored,
    )  # fmt: skip
    assert len(pids) == 3
    cli.send_signal(signal.SIGINT)
    out, _ = cli.communicate(timeout=30)
    assert cli.returncode == 0, out
    assert "stopped every process" in out
    assert all(gone(pid) for pid in pids)


def test_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    cli, pids = _run_cli(tmp_path, server("engine-0", free_port(), 0))
    cli.kill()  # no chance to clean up: PR_SET_PDEATHSIG must do it
    cli.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids)
