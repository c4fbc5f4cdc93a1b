"""Run a ``Plan`` across a Ray cluster: Ray places, we only start argv lists.

One placement-group bundle per plan node (``{"CPU": c, "GPU": g}``, ``g`` = the GPUs the
node's processes ask for) and one small host actor pinned to each bundle; the actor starts
that node's argv lists as subprocesses (each in its own session, so stopping reaches its whole
tree) and hands output lines back to the driver, which prints them with ``[name]`` prefixes.
Placeholders ``{node_ip:K}`` resolve to the address Ray reports for bundle K, which is how
torchrun agents find their c10d rendezvous host and the router finds its engines.

Departures: Ray assigns GPUs itself, so the plan's node-local ``CUDA_VISIBLE_DEVICES`` /
``HIP_VISIBLE_DEVICES`` indices are translated through the GPU ids Ray gave the host actor. The default
strategy is ``SPREAD`` rather than ``STRICT_SPREAD`` so a one-machine cluster (tests, a single
big node) can host a multi-node plan; pass ``strategy="STRICT_SPREAD"`` on a real cluster.
Requires the ``ray`` extra; nothing here imports Ray at module import time.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Self

import httpx

from posttrain.interface.processes import stop_process_groups
from posttrain.launch._errors import LaunchConfigError, ProcessFailedError, ReadinessError
from posttrain.launch.plan import Plan, ProcessSpec, resolve, resolve_process
from posttrain.launch.runners import LogSink, console_sink, register_worker

_VISIBLE_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
RAY_STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK")
"""The placement-group strategies ``RayRunner`` accepts."""


class ProcessHost:
    """Runs the plan's processes of one node, on whatever machine Ray placed this actor."""

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lines: dict[str, deque[str]] = {}

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def python(self) -> str:
        return sys.executable

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        import ray

        full_env = dict(os.environ)
        full_env.update(_map_visible_devices(env, [str(g) for g in ray.get_gpu_ids()]))
        popen = subprocess.Popen(
            argv,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        lines: deque[str] = deque(maxlen=10_000)
        self._procs[name], self._lines[name] = popen, lines
        stream = popen.stdout
        assert stream is not None

        def pump() -> None:
            for raw in iter(stream.readline, b""):
                lines.append(raw.decode("utf-8", "replace").rstrip("\r\n"))

        threading.Thread(target=pump, daemon=True).start()
        return popen.pid

    def poll(self, name: str) -> tuple[int | None, list[str]]:
        """(exit code or None, output lines since the last poll) of process ``name``."""
        lines = self._lines[name]
        out = [lines.popleft() for _ in range(len(lines))]
        return self._procs[name].poll(), out

    def stop(self, timeout_s: float) -> dict[str, int | None]:
        """SIGTERM every process group (reverse start order), SIGKILL after ``timeout_s``."""
        codes = stop_process_groups(list(self._procs.values()), grace_s=timeout_s)
        return dict(zip(self._procs, codes, strict=True))


def _map_visible_devices(env: dict[str, str], assigned: list[str]) -> dict[str, str]:
    """Translate the plan's node-local device indices through the GPUs Ray gave this actor."""
    out = dict(env)
    for var in _VISIBLE_ENV:
        if var not in out:
            continue
        if not assigned:
            del out[var]
            continue
        try:
            out[var] = ",".join(assigned[int(i)] for i in out[var].split(","))
        except (ValueError, IndexError):
            raise LaunchConfigError(
                f"{var}={out[var]} names devices beyond the {len(assigned)} Ray assigned"
            ) from None
    return out


class RayRunner:
    """Places and runs a plan on an existing Ray cluster (``address``), then tears it down."""

    def __init__(
        self,
        plan: Plan,
        *,
        address: str = "auto",
        sink: LogSink | None = None,
        strategy: str = "SPREAD",
        cpus_per_node: float = 1.0,
        placement_timeout_s: float = 120.0,
        stop_timeout_s: float = 15.0,
        poll_s: float = 0.3,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if strategy not in RAY_STRATEGIES:
            raise LaunchConfigError(
                f"strategy {strategy!r} is not one of {', '.join(RAY_STRATEGIES)}"
            )
        self.plan = plan
        self.address = address
        self.sink = sink or console_sink()
        self.strategy = strategy
        self.cpus_per_node = cpus_per_node
        self.placement_timeout_s = placement_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self._client = httpx.Client(transport=transport, timeout=httpx.Timeout(2.0))
        self._pg: Any = None
        self._hosts: dict[int, Any] = {}  # plan node -> ProcessHost actor
        self.pids: dict[str, int] = {}
        self.node_ips: dict[int, str] = {}
        self._owns_ray = False
        self._stopped = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Place one host actor per plan node, then start stage by stage (see module doc)."""
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
            try:
                ray.init(address=self.address, log_to_driver=False)
            except ConnectionError as exc:  # no cluster at the address (or none running)
                raise LaunchConfigError(
                    f"no Ray cluster at address {self.address!r} (start one with `ray start "
                    f"--head`, or pass --ray-address HOST:PORT): {exc}"
                ) from None
            self._owns_ray = True
        nodes = range(max(self.plan.nodes, 1))
        gpus = {n: sum(p.gpus for p in self.plan.processes if p.node == n) for n in nodes}
        bundles = [
            {"CPU": self.cpus_per_node, **({"GPU": float(gpus[n])} if gpus[n] else {})}
            for n in nodes
        ]
        self._pg = placement_group(bundles, strategy=self.strategy)
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise LaunchConfigError(
                f"Ray at {self.address} could not place plan {self.plan.name!r} "
                f"({bundles}, {self.strategy}) within {self.placement_timeout_s:.0f} s"
            )
        host_cls = ray.remote(ProcessHost)
        for n in nodes:
            self._hosts[n] = host_cls.options(
                num_cpus=self.cpus_per_node,
                num_gpus=gpus[n],
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=n
                ),
            ).remote()
        ips = ray.get([self._hosts[n].node_ip.remote() for n in nodes])
        pythons = ray.get([self._hosts[n].python.remote() for n in nodes])
        self.node_ips = dict(zip(nodes, ips, strict=True))
        for stage in self.plan.stages:
            for spec in stage:
                argv, env, _ = resolve_process(spec, self.node_ips, pythons[spec.node])
                host = self._hosts[spec.node]
                self.pids[spec.name] = ray.get(host.start.remote(spec.name, argv, env))
                self.sink(
                    "launcher",
                    f"started {spec.name} pid {self.pids[spec.name]} "
                    f"on node {spec.node} ({self.node_ips[spec.node]})",
                )
            for spec in stage:
                self._await_ready(spec)
            for reg in self.plan.registrations:
                if reg.after_stage == stage[0].stage:
                    router, worker = register_worker(self._client, reg, self.node_ips, self.poll_s)
                    self.sink("launcher", f"registered {worker} with {router}")

    def _drain(self, spec: ProcessSpec) -> int | None:
        import ray

        code, lines = ray.get(self._hosts[spec.node].poll.remote(spec.name))
        for line in lines:
            self.sink(spec.name, line)
        return code  # type: ignore[no-any-return]

    def _await_ready(self, spec: ProcessSpec) -> None:
        if spec.readiness is None:
            return
        url = resolve(spec.readiness.url, spec.node, self.node_ips)
        deadline = time.monotonic() + spec.readiness.timeout_s
        while time.monotonic() < deadline:
            code = self._drain(spec)
            if code is not None:
                raise ProcessFailedError(
                    f"process {spec.name} (pid {self.pids[spec.name]}) exited with code {code} "
                    "before it was ready",
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
                code = self._drain(spec)
                if code is None or spec.name in done:
                    continue
                if spec.readiness is not None or code != 0:
                    raise ProcessFailedError(
                        f"process {spec.name} (pid {self.pids[spec.name]}) exited with code {code}",
                        process=spec.name,
                        pid=self.pids[spec.name],
                        returncode=code,
                    )
                done[spec.name] = code
            time.sleep(self.poll_s)
        return done

    def stop(self) -> None:
        """Stop every process (reverse node order), kill the actors, remove the placement group."""
        if self._stopped:
            return
        self._stopped = True
        import ray

        if not ray.is_initialized():
            return
        for node in reversed(list(self._hosts)):
            with contextlib.suppress(Exception):
                ray.get(self._hosts[node].stop.remote(self.stop_timeout_s))
            for spec in self.plan.processes:
                if spec.node == node and spec.name in self.pids:
                    with contextlib.suppress(Exception):
                        self._drain(spec)
            with contextlib.suppress(Exception):
                ray.kill(self._hosts[node])
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        self._client.close()
        if self._owns_ray:
            ray.shutdown()
        self.sink("launcher", f"stopped {len(self.pids)} process(es) on Ray")
