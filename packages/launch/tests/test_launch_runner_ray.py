"""RayRunner against a real local Ray head (CPU resources only), driven through the CLI.

The plan spans two plan nodes on the one machine: an HTTP service that must become ready,
then two torchrun agents (one per plan node) meeting through c10d rendezvous at the address
Ray reports for node 0 and running one gloo all-reduce. Ray and gloo are pinned to loopback.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from posttrain.interface.testing import free_port
from posttrain.launch import Plan, ProcessSpec, Readiness, Role
from posttrain.launch.planner import torchrun_argv

pytest.importorskip("ray", reason="the Ray runner needs the `ray` extra")

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray then uses 127.0.0.1 as the node address
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "GLOO_SOCKET_IFNAME": "lo",
}


def _stop_tree(root: psutil.Process, timeout_s: float = 5.0) -> list[psutil.Process]:
    """SIGTERM the head's process group, then SIGKILL whatever is left of the tree or group.

    Called before the head is reaped, so its pid (the group id) cannot have been reused.
    """
    procs = [root]
    with contextlib.suppress(psutil.Error):
        procs += root.children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root.pid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=timeout_s)
    return procs


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start_head(
    ray_bin: str, temp_dir: Path
) -> tuple[subprocess.Popen[str], psutil.Process, str, list[str]]:
    """``ray start --head --block``; returns once it reports "Ray runtime started" or exits."""
    port = free_port()
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "4", "--num-gpus", "0",
         "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", str(temp_dir)],
        env={**os.environ, **LOOPBACK_ENV, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    root = psutil.Process(head.pid)  # before anything can reap it
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:  # connecting before the raylet registered fails: wait for the word
        assert head.stdout is not None
        for line in head.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()
        started.set()  # exited

    threading.Thread(target=read, daemon=True).start()
    started.wait(timeout=150)
    return head, root, f"127.0.0.1:{port}", lines


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    ray_bin = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert ray_bin is not None
    # Ray gives its raylet a fixed 30 s to register with the GCS; on an overloaded machine
    # that can lapse once, so a second head is tried before the test fails.
    for attempt in (1, 2):
        head, root, address, lines = _start_head(ray_bin, tmp_path_factory.mktemp(f"r{attempt}"))
        up = any("Ray runtime started" in line for line in lines) and not _gone(root)
        if up:
            break
        procs = _stop_tree(root)
        head.wait(timeout=30)
        assert all(_gone(p) for p in procs)
    assert up, "ray start --head did not come up twice:\n" + "".join(lines[-20:])
    try:
        yield address
    finally:
        procs = _stop_tree(root)
        head.wait(timeout=30)
        assert all(_gone(p) for p in procs), "a Ray head process survived"


def test_ray_runner_places_service_and_torchrun_ranks(ray_head: str, tmp_path: Path) -> None:
    service_port, rdzv_port = free_port(), free_port()
    trainer_argv = torchrun_argv(
        nnodes=2,
        nproc_per_node=1,
        rendezvous=f"{{node_ip:0}}:{rdzv_port}",
        run_id="ray-test",
        entry=(str(HERE / "allreduce_job.py"),),
    )
    plan = Plan(
        name="ray-test",
        hardware="cpu",
        nodes=2,
        processes=(
            ProcessSpec(
                name="engine-0",
                role=Role.ENGINE,
                argv=("python", str(HERE / "serve_health.py"), str(service_port)),
                node=0,
                stage=0,
                readiness=Readiness(url=f"http://{{node_ip}}:{service_port}/health", timeout_s=120),
            ),
            *(
                ProcessSpec(
                    name=f"trainer-{k}", role=Role.TRAINER, argv=tuple(trainer_argv), node=k,
                    stage=1, env={"CUDA_VISIBLE_DEVICES": "0"},
                )
                for k in (0, 1)
            ),
        ),
    )  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    cli = subprocess.run(
        [sys.executable, "-m", "posttrain.launch", "run", str(path), "--runner", "ray",
         "--ray-address", ray_head],
        env={**os.environ, **LOOPBACK_ENV},
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    out = cli.stdout + cli.stderr
    assert cli.returncode == 0, out
    assert "engine-0 ready at http://127.0.0.1:" in out
    assert "[trainer-0] rank 0 of 2 sum 3.0" in out or "[trainer-1] rank 0 of 2 sum 3.0" in out
    assert "rank 1 of 2 sum 3.0" in out
    assert "stopped 3 process(es) on Ray" in out
    survivors = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(service_port) in " ".join(p.info["cmdline"] or []) and not _gone(p)
    ]
    assert survivors == []
