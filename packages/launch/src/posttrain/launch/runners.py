"""Runners execute a ``Plan``: ``DryRun`` prints it, ``LocalRunner`` runs it on this machine.

``LocalRunner`` spawns every process of a stage before awaiting any, waits for each readiness
URL, streams every line of output with a ``[name]`` prefix, and stops everything by pid on
exit, error or Ctrl-C. No orphans, by three means: each child leads its own session (so a
terminal Ctrl-C reaches only the launcher, which then stops children in order, and
``killpg`` reaches every process a child spawned); the descendants of each child are
snapshotted with psutil before signalling and killed too if they left the group; and on Linux
each child gets ``PR_SET_PDEATHSIG`` so it receives SIGTERM if the launcher itself is killed.

The Ray runner lives in ``ray_runner.py`` (Ray is an optional extra).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Self

import httpx
import psutil
from rich.console import Console
from rich.text import Text

from posttrain.launch._errors import ProcessFailedError, ReadinessError
from posttrain.launch.plan import Plan, ProcessSpec, Registration, Role, resolve, resolve_process

LogSink = Callable[[str, str], None]  # (process name, line without newline)
# (process name, what happened): "starting", "ready", "registered", "stopping", "stopped"
EventSink = Callable[[str, str], None]

_COLORS = ("cyan", "magenta", "green", "yellow", "blue", "red")


def console_sink(console: Console | None = None) -> LogSink:
    """A sink printing ``[name] line`` with a stable colour per process name."""
    out = console or Console(stderr=True, highlight=False)
    colors: dict[str, str] = {}
    cycle = itertools.cycle(_COLORS)
    lock = threading.Lock()

    def sink(name: str, line: str) -> None:
        with lock:
            color = colors.setdefault(name, next(cycle))
        out.print(Text(f"[{name}] ", style=color) + Text(line), soft_wrap=True)

    return sink


def tail_sink(lines: int = 60) -> tuple[LogSink, collections.deque[str]]:
    """A sink that keeps the last ``lines`` process log lines (shown only when something fails)."""
    kept: collections.deque[str] = collections.deque(maxlen=lines)

    def sink(name: str, line: str) -> None:
        kept.append(f"[{name}] {line}")

    return sink, kept


def register_worker(
    client: httpx.Client, reg: Registration, node_ips: Mapping[int, str], poll_s: float = 0.2
) -> tuple[str, str]:
    """POST the worker to the router and wait until ``GET /workers`` lists it healthy.

    sgl-router answers 202 (queued) and registers in the background, hence the poll.
    """
    router = resolve(reg.router, 0, node_ips).rstrip("/")
    worker = resolve(reg.worker, 0, node_ips).rstrip("/")
    try:
        reply = client.post(f"{router}/workers", json={"url": worker, "worker_type": "regular"})
    except httpx.HTTPError as exc:
        raise ReadinessError(
            f"router {router} unreachable registering {worker}: {type(exc).__name__}",
            process="router",
            url=f"{router}/workers",
        ) from exc
    if reply.status_code not in (200, 201, 202):
        raise ReadinessError(
            f"POST {router}/workers for {worker} answered {reply.status_code}: {reply.text[:200]}",
            process="router",
            url=f"{router}/workers",
        )
    deadline = time.monotonic() + reg.timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            listed = client.get(f"{router}/workers").json().get("workers", [])
            for w in listed:
                url = str(w.get("url", "")).split("@", 1)[0].rstrip("/")
                if url == worker and w.get("is_healthy", True):
                    return router, worker
        time.sleep(poll_s)
    raise ReadinessError(
        f"router {router} did not list {worker} as healthy within {reg.timeout_s:.0f} s",
        process="router",
        url=f"{router}/workers",
    )


class DryRun:
    """Prints the plan (argv as shell-quoted text, then the explanation); starts nothing."""

    def __init__(self, plan: Plan, *, console: Console | None = None) -> None:
        self.plan = plan
        self.console = console or Console(highlight=False)

    def run(self) -> None:
        self.console.print(self.plan.to_shell(), markup=False)
        self.console.print(self.plan.explain(), markup=False)


@dataclass(slots=True)
class RunningProcess:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    url: str | None
    thread: threading.Thread

    @property
    def pid(self) -> int:
        return self.popen.pid


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pump(stream: IO[bytes], name: str, sink: LogSink) -> None:
    for raw in iter(stream.readline, b""):
        sink(name, raw.decode("utf-8", "replace").rstrip("\r\n"))
    stream.close()


class LocalRunner:
    """Runs a plan's processes on this machine; use as a context manager (stops on exit)."""

    def __init__(
        self,
        plan: Plan,
        *,
        sink: LogSink | None = None,
        host: str = "127.0.0.1",
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
        poll_s: float = 0.2,
        stop_timeout_s: float = 15.0,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
        on_event: EventSink | None = None,
    ) -> None:
        self.plan = plan
        self.sink = sink or console_sink()
        self.on_event = on_event or (lambda name, what: None)
        self.node_ips = dict.fromkeys(range(max(plan.nodes, 1)), host)
        self.python = python
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.poll_s = poll_s
        self.stop_timeout_s = stop_timeout_s
        # The stack's key (if any) goes on readiness checks and registrations: a session router
        # started with --api-key answers 401 to an unauthenticated /health.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._api_key = api_key
        self._client = httpx.Client(
            transport=transport, timeout=httpx.Timeout(2.0), headers=headers
        )
        self.running: list[RunningProcess] = []
        self._stopped = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def urls(self) -> dict[str, str]:
        """Base URL of every started process that has a readiness URL."""
        out = {}
        for rp in self.running:
            if rp.url is not None:
                out[rp.spec.name] = rp.url.rsplit("/", 1)[0]
        return out

    def start(self) -> None:
        """Start every stage in order; on any failure stop what was started and re-raise."""
        try:
            if self.plan.nodes > 1:
                self.sink("launcher", f"running a {self.plan.nodes}-node plan on one machine")
            for stage in self.plan.stages:
                started = [self._spawn(spec) for spec in stage]
                for rp in started:
                    self._await_ready(rp)
                for reg in self.plan.registrations:
                    if reg.after_stage == stage[0].stage:
                        router, worker = register_worker(
                            self._client, reg, self.node_ips, self.poll_s
                        )
                        self.sink("launcher", f"registered {worker} with {router}")
                        self.on_event(worker, "registered")
        except BaseException:
            self.stop()
            raise

    def _spawn(self, spec: ProcessSpec) -> RunningProcess:
        argv, env, url = resolve_process(spec, self.node_ips, self.python)
        popen = subprocess.Popen(
            argv,
            env={**self.base_env, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,
        )
        assert popen.stdout is not None
        thread = threading.Thread(
            target=_pump, args=(popen.stdout, spec.name, self.sink), daemon=True
        )
        thread.start()
        rp = RunningProcess(spec=spec, popen=popen, url=url, thread=thread)
        self.running.append(rp)
        shown = " ".join(argv)
        if self._api_key:  # the log names the key file's contents nowhere
            shown = shown.replace(self._api_key, "<the stack's API key>")
        self.sink("launcher", f"started {spec.name} pid {popen.pid}: {shown}")
        self.on_event(spec.name, "starting")
        return rp

    def _check_alive(self, rp: RunningProcess) -> None:
        code = rp.popen.poll()
        if code is not None:
            raise ProcessFailedError(
                f"process {rp.spec.name} (pid {rp.pid}) exited with code {code}",
                process=rp.spec.name,
                pid=rp.pid,
                returncode=code,
            )

    def _await_ready(self, rp: RunningProcess) -> None:
        if rp.url is None or rp.spec.readiness is None:
            return
        deadline = time.monotonic() + rp.spec.readiness.timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            self._check_alive(rp)
            try:
                reply = self._client.get(rp.url)
                if reply.status_code == 200:
                    self.sink("launcher", f"{rp.spec.name} ready at {rp.url}")
                    self.on_event(rp.spec.name, "ready")
                    return
                last = f"HTTP {reply.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}"
            time.sleep(self.poll_s)
        raise ReadinessError(
            f"process {rp.spec.name} (pid {rp.pid}) not ready at {rp.url} after "
            f"{rp.spec.readiness.timeout_s:.0f} s (last: {last})",
            process=rp.spec.name,
            url=rp.url,
        )

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until a process exits (raise ``ProcessFailedError``) or the timeout passes.

        A trainer that exits 0 ends the run normally. ``timeout_s=None`` waits until a
        process exits or the caller is interrupted (Ctrl-C).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            for rp in self.running:
                code = rp.popen.poll()
                if code is None:
                    continue
                if code == 0 and rp.spec.role is Role.TRAINER:
                    return
                self._check_alive(rp)
            time.sleep(self.poll_s)

    def stop(self) -> None:
        """SIGTERM every process group (reverse start order), then SIGKILL what is left."""
        if self._stopped:
            return
        self._stopped = True
        self.on_event("stack", "stopping")
        tracked: list[psutil.Process] = []
        for rp in self.running:
            with contextlib.suppress(psutil.Error):
                parent = psutil.Process(rp.pid)
                tracked.extend([parent, *parent.children(recursive=True)])
        for rp in reversed(self.running):
            _signal_group(rp.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(tracked, timeout=self.stop_timeout_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                self.sink("launcher", f"pid {proc.pid} ignored SIGTERM; killing")
                proc.kill()
        psutil.wait_procs(alive, timeout=self.stop_timeout_s)
        for rp in self.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rp.popen.wait(timeout=self.stop_timeout_s)
            rp.thread.join(timeout=2.0)
        self._client.close()
        self.sink("launcher", f"stopped {len(self.running)} process(es)")
        self.on_event("stack", "stopped")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
