"""Run a ``Plan`` across a Ray cluster: Ray places, we only start argv lists.

One placement-group bundle per plan node (``{"CPU": c, "GPU": g}``, ``g`` = the GPUs the
node's processes ask for). Each process runs inside a small Ray actor pinned to its node's
bundle; the actor starts the argv as a subprocess (own session, so stopping reaches its whole
tree) and hands output lines back to the driver, which prints them with ``[name]`` prefixes.
Placeholders ``{node_ip:K}`` resolve to the address Ray reports for bundle K, which is how
torchrun agents find their c10d rendezvous host and the router finds its engines.

Departures: Ray assigns GPUs itself, so the plan's ``CUDA_VISIBLE_DEVICES`` /
``HIP_VISIBLE_DEVICES`` are dropped and the actor's own (set by Ray) is inherited. The default
strategy is ``SPREAD`` rather than ``STRICT_SPREAD`` so a one-machine cluster (tests, a single
big node) can host a multi-node plan; pass ``strategy="STRICT_SPREAD"`` on a real cluster.
Requires the ``ray`` extra; nothing here imports Ray at module import time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Self

import httpx

from posttrain.launch._errors import LaunchConfigError, ProcessFailedError, ReadinessError
from posttrain.launch.plan import Plan, ProcessSpec, resolve_process
from posttrain.launch.runners import LogSink, console_sink

_DROPPED_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


class ProcessHost:
    """Runs one argv as a subprocess on whatever node Ray placed this actor on."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._lines: deque[str] = deque(maxlen=10_000)
        self._thread: threading.Thread | None = None

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def python(self) -> str:
        return sys.executable

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        full_env = dict(os.environ)
        full_env.update(env)
        self._popen = subprocess.Popen(
            argv,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        stream = self._popen.stdout
        assert stream is not None

        def pump() -> None:
            for raw in iter(stream.readline, b""):
                self._lines.append(raw.decode("utf-8", "replace").rstrip("\r\n"))

        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()
        return self._popen.pid

    def poll(self) -> tuple[int | None, list[str]]:
        """(exit code or None, output lines since the last poll)."""
        lines = []
        while self._lines:
            lines.append(self._lines.popleft())
        code = None if self._popen is None else self._popen.poll()
        return code, lines

    def stop(self, timeout_s: float) -> int | None:
        if self._popen is None:
            return None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signal.SIGTERM)
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            return self._popen.wait(timeout=timeout_s)


class RayRunner:
    """Places and runs a plan on an existing Ray cluster (``address``), then tears it down."""

    def __init__(
        self,
        plan: Plan,
        *,
        address: str = "auto",
        sink: LogSink | None = None,
        strategy: str = "SPREAD",
        cpus_per_process: float = 0.25,
        placement_timeout_s: float = 120.0,
        stop_timeout_s: float = 15.0,
        poll_s: float = 0.3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.plan = plan
        self.address = address
        self.sink = sink or console_sink()
        self.strategy = strategy
        self.cpus_per_process = cpus_per_process
        self.placement_timeout_s = placement_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self._client = httpx.Client(transport=transport, timeout=httpx.Timeout(2.0))
        self._pg: Any = None
        self._actors: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.node_ips: dict[int, str] = {}
        self._owns_ray = False
        self._stopped = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, include_dashboard=False)
            self._owns_ray = True
        nodes = max(self.plan.nodes, 1)
        bundles = []
        for node in range(nodes):
            procs = [p for p in self.plan.processes if p.node == node]
            bundle: dict[str, float] = {"CPU": self.cpus_per_process * max(len(procs), 1)}
            gpus = sum(p.gpus for p in procs)
            if gpus:
                bundle["GPU"] = float(gpus)
            bundles.append(bundle)
        self._pg = placement_group(bundles, strategy=self.strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise LaunchConfigError(
                f"Ray at {self.address} could not place plan {self.plan.name!r} "
                f"({bundles}, {self.strategy}) within {self.placement_timeout_s:.0f} s"
            )
        host_cls = ray.remote(ProcessHost)

        def make_actor(spec: ProcessSpec, node: int) -> Any:
            return host_cls.options(
                num_cpus=self.cpus_per_process,
                num_gpus=spec.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=node
                ),
            ).remote()

        # Learn each bundle's address from an actor placed there (the first process of it).
        firsts = {}
        for spec in self.plan.processes:
            if spec.node not in firsts:
                firsts[spec.node] = spec
                self._actors[spec.name] = make_actor(spec, spec.node)
        for node, spec in firsts.items():
            self.node_ips[node] = ray.get(self._actors[spec.name].node_ip.remote())
        for stage in self.plan.stages:
            for spec in stage:
                actor = self._actors.get(spec.name) or make_actor(spec, spec.node)
                self._actors[spec.name] = actor
                python = ray.get(actor.python.remote())
                argv, env, _ = resolve_process(spec, self.node_ips, python)
                env = {k: v for k, v in env.items() if k not in _DROPPED_ENV}
                self.pids[spec.name] = ray.get(actor.start.remote(argv, env))
                self.sink("launcher", f"started {spec.name} on {self.node_ips[spec.node]}")
            for spec in stage:
                self._await_ready(spec)

    def _drain(self, name: str) -> int | None:
        import ray

        code, lines = ray.get(self._actors[name].poll.remote())
        for line in lines:
            self.sink(name, line)
        return code  # type: ignore[no-any-return]

    def _await_ready(self, spec: ProcessSpec) -> None:
        if spec.readiness is None:
            return
        _, _, url = resolve_process(spec, self.node_ips, "python")
        assert url is not None
        deadline = time.monotonic() + spec.readiness.timeout_s
        while time.monotonic() < deadline:
            code = self._drain(spec.name)
            if code is not None:
                raise ProcessFailedError(
                    f"process {spec.name} exited with code {code} before it was ready",
                    process=spec.name,
                    pid=self.pids[spec.name],
                    returncode=code,
                )
            with contextlib.suppress(httpx.HTTPError):
                if self._client.get(url).status_code == 200:
                    self.sink("launcher", f"{spec.name} ready at {url}")
                    return
            time.sleep(self.poll_s)
        raise ReadinessError(
            f"process {spec.name} not ready at {url} after {spec.readiness.timeout_s:.0f} s",
            process=spec.name,
            url=url,
        )

    def wait(self, timeout_s: float | None = None) -> dict[str, int]:
        """Stream output until every readiness-less process (trainers) exits; their codes.

        A server exiting, or any trainer exiting non-zero, raises ``ProcessFailedError``.
        """
        jobs = [p for p in self.plan.processes if p.readiness is None]
        done: dict[str, int] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(done) < len(jobs):
            if deadline is not None and time.monotonic() > deadline:
                break
            for spec in self.plan.processes:
                code = self._drain(spec.name)
                if code is None or spec.name in done:
                    continue
                if spec.readiness is not None or code != 0:
                    raise ProcessFailedError(
                        f"process {spec.name} exited with code {code}",
                        process=spec.name,
                        pid=self.pids[spec.name],
                        returncode=code,
                    )
                done[spec.name] = code
            time.sleep(self.poll_s)
        return done

    def stop(self) -> None:
        """Stop every subprocess (reverse order), kill the actors, remove the placement group."""
        if self._stopped:
            return
        self._stopped = True
        import ray

        if not ray.is_initialized():
            return
        for name in reversed(list(self._actors)):
            with contextlib.suppress(Exception):
                ray.get(self._actors[name].stop.remote(self.stop_timeout_s))
                self._drain(name)
            with contextlib.suppress(Exception):
                ray.kill(self._actors[name])
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        self._client.close()
        if self._owns_ray:
            ray.shutdown()
        self.sink("launcher", f"stopped {len(self._actors)} process(es) on Ray")
