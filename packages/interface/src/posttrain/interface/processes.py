"""Child processes on one machine: loopback ports, servers stopped by pid, groups of ranks.

This is runtime code, not test code: ``python -m posttrain.fsdp_mesh.parity`` launches its
ranks with ``run_workers``, session-router starts sgl-router with these helpers, and launch picks
ports with ``free_port``. It lives in the interface because every layer above may use it and it
imports nothing heavy: torch is imported only inside worker processes (and, with the default
``fork``, once in the parent just before forking, so ranks inherit it warm).
``posttrain.interface.testing`` re-exports it for tests.

- ``free_port`` finds a free TCP port (127.0.0.1 by default).
- ``wait_until_ready`` polls a URL until it answers 200, failing fast when the process exits.
- ``stop_process_group`` / ``stop_process_groups`` send SIGTERM to children's process groups,
  then SIGKILL after a grace period: each child was started with ``start_new_session=True``, so
  its pid is its group id and whatever it spawned goes with it, and nothing else does.
- ``run_workers`` runs ``fn(rank, world_size, *args)`` on N local ranks, each with a gloo or
  NCCL process group (or none), and returns the results by rank.

Departures of ``run_workers`` from ``torch.multiprocessing.spawn``: one deadline covers the whole
group, and when it passes every rank still alive is killed (``WorkerTimeoutError`` names the ranks
that had not finished), so a hung rank fails a test or a CLI, never a CI job; a rank that raises
or dies makes the parent collect failures for a moment and name the cause (a rank that died
without reporting comes before ranks that then raised "connection reset by its peer"; otherwise
the earliest failure wins); results cross the queue as plain pickles, so tensors travel by value
rather than through shared memory that vanishes with the rank; on Linux a rank dies with its
parent (``PR_SET_PDEATHSIG``), so killing a launcher never leaves ranks behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import pickle
import queue as queue_module
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

from posttrain.interface._errors import (
    ConfigError,
    ServerStartError,
    WorkerCrashedError,
    WorkerFailedError,
    WorkerTimeoutError,
)

__all__ = [
    "DEFAULT_PRELOAD",
    "StartMethod",
    "free_port",
    "free_ports",
    "run_workers",
    "stop_process_group",
    "stop_process_groups",
    "wait_until_ready",
]

_LOOPBACK = "127.0.0.1"
StartMethod = Literal["fork", "spawn", "forkserver"]
DEFAULT_PRELOAD = ("torch", "torch.distributed")
"""Modules a ``forkserver`` imports once, so each later group starts without importing them."""
# After the first failure, how long the parent waits for the other ranks' reports.
_FAILURE_WINDOW_S = 2.0


def free_port(host: str = _LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (another process may take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int, host: str = _LOOPBACK) -> tuple[int, ...]:
    """``count`` distinct TCP ports on ``host``, free a moment ago.

    The sockets stay bound until every port is chosen, so the ports differ from each other
    (``free_port`` called ``count`` times may hand the same port out twice).
    """
    if count < 0:
        raise ConfigError(f"count must be >= 0, got {count}")
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for sock in sockets:
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)


def _answers_ok(url: str, *, timeout_s: float = 2.0) -> bool:
    """True when a GET of ``url`` answers HTTP 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_until_ready(
    url: str,
    *,
    timeout_s: float,
    process: subprocess.Popen[Any] | None = None,
    poll_interval_s: float = 0.05,
) -> None:
    """Poll ``url`` until it answers 200; ``ServerStartError`` if ``process`` exits or time runs out.

    The caller owns the process: it is not stopped here.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        code = None if process is None else process.poll()
        if code is not None:
            raise ServerStartError(f"the process exited with code {code} before {url} was ready")
        if _answers_ok(url, timeout_s=min(2.0, max(timeout_s, 0.1))):
            return
        if time.monotonic() > deadline:
            raise ServerStartError(f"{url} was not ready within {timeout_s:g} s")
        time.sleep(poll_interval_s)


def _signal_group(process: subprocess.Popen[Any], sig: signal.Signals) -> None:
    if process.poll() is None:  # not yet reaped, so its pid (the group id) is still its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)


def stop_process_groups(
    processes: Sequence[subprocess.Popen[Any]], *, grace_s: float = 5.0
) -> list[int | None]:
    """SIGTERM the groups led by ``processes`` (last started first), SIGKILL what is left after
    ``grace_s``; their exit codes, in order.

    Each process must have been started with ``start_new_session=True`` (its pid is then its
    process-group id, and the group holds only it and its descendants). All groups share one
    grace period, so stopping N servers takes ``grace_s`` at most, not N times it.
    """
    for process in reversed(processes):
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            codes.append(process.wait(timeout=grace_s))
    return codes


def stop_process_group(process: subprocess.Popen[Any], *, grace_s: float = 5.0) -> int | None:
    """SIGTERM the group led by ``process`` (its pid), SIGKILL after ``grace_s``; the exit code."""
    return stop_process_groups([process], grace_s=grace_s)[0]


def _worker_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    args: Sequence[Any],
    results: Any,
    threads_per_rank: int | None,
    pg_timeout_s: float,
    stacks_dir: str,
) -> None:
    try:
        _die_with_parent()
        _dump_stacks_on_request(stacks_dir, rank)
        os.environ.update(
            MASTER_ADDR=_LOOPBACK,
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
        )
        import torch
        import torch.distributed as dist

        if threads_per_rank is not None:
            torch.set_num_threads(threads_per_rank)
        if backend is not None:
            device_id = None
            if backend == "nccl":
                device_id = torch.device("cuda", rank % torch.cuda.device_count())
                torch.cuda.set_device(device_id)
            dist.init_process_group(
                backend,
                init_method=f"tcp://{_LOOPBACK}:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
                device_id=device_id,
            )
        try:
            value = fn(rank, world_size, *args)
        except BaseException:
            # Report before tearing the group down: the teardown makes peers fail too, and the
            # parent names the rank whose failure came first.
            results.put((rank, False, (time.time(), traceback.format_exc())))
            raise
        finally:
            if backend is not None and dist.is_initialized():
                dist.destroy_process_group()
        # Pickle by value here: torch would otherwise pass tensors through shared memory
        # that vanishes when this rank exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, (time.time(), traceback.format_exc())))
        results.close()
        results.join_thread()
        os._exit(1)


_STACKS_SIGNAL = signal.SIGUSR1
_STACKS_WAIT_S = 2.0
_STACKS_CHARS = 6000


def _stacks_file(stacks_dir: str, rank: int) -> str:
    return os.path.join(stacks_dir, f"rank{rank}.txt")


def _dump_stacks_on_request(stacks_dir: str, rank: int) -> None:
    """On ``SIGUSR1`` this rank writes every thread's Python stack to its file in
    ``stacks_dir`` (faulthandler: works while the rank is stuck in C code too)."""
    stacks = open(_stacks_file(stacks_dir, rank), "w")  # noqa: SIM115 (open for the rank's life)
    faulthandler.register(_STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _hung_stacks(
    processes: Sequence[multiprocessing.process.BaseProcess], ranks: Sequence[int], stacks_dir: str
) -> str:
    """Ask the hung ``ranks`` for their Python stacks (before they are killed); the text to
    append to the timeout's message, naming the rank of each stack."""
    asked = []
    for rank in ranks:
        pid = processes[rank].pid
        if pid is not None and processes[rank].is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, _STACKS_SIGNAL)
                asked.append(rank)
    sizes: dict[int, int] = {}
    until = time.monotonic() + _STACKS_WAIT_S
    while asked and time.monotonic() < until:  # until every dump is written and stopped growing
        time.sleep(0.1)
        now = {r: _size(_stacks_file(stacks_dir, r)) for r in asked}
        if all(now[r] > 0 and now[r] == sizes.get(r) for r in asked):
            break
        sizes = now
    texts = {}
    for rank in asked:
        with contextlib.suppress(OSError), open(_stacks_file(stacks_dir, rank)) as f:
            texts[rank] = f.read()
    parts = []
    for rank in ranks:
        text = texts.get(rank, "").strip()
        if not text:
            parts.append(f"rank {rank}: no stack (it did not answer {_STACKS_SIGNAL.name})")
            continue
        if len(text) > _STACKS_CHARS:
            text = "...\n" + text[-_STACKS_CHARS:]
        parts.append(f"rank {rank}'s Python stacks when it was killed:\n{text}")
    return "\n".join(parts)


_FORK_HAZARDS = ("pt_tcpstore", "pt_gloo", "gloo_", "pt_nccl")
"""Thread names (Linux ``comm``) of torch.distributed's stores and backends: a rank forked while
such threads run inherits whatever locks they held at that instant."""


def _fork_hazards() -> list[str]:
    """The torch.distributed threads alive in this process now (Linux; [] elsewhere)."""
    names = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
                if name.startswith(_FORK_HAZARDS):
                    names.append(name)
    return sorted(set(names))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a forked rank outlives nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill_all(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=5)


def _crash(rank: int, world_size: int, code: int | None, after: str = "") -> WorkerCrashedError:
    how = f"signal {-code}" if code is not None and code < 0 else f"code {code}"
    return WorkerCrashedError(
        f"rank {rank} of {world_size} exited with {how} before returning a result{after}",
        rank=rank,
    )


def _first_failure(
    results: Any,
    processes: Sequence[multiprocessing.process.BaseProcess],
    rank: int,
    report: tuple[float, str],
) -> WorkerCrashedError | WorkerFailedError:
    """Collect failures for a moment; the cause is a rank that died silently, else the earliest."""
    world_size = len(processes)
    failures = {rank: report}
    until = time.monotonic() + _FAILURE_WINDOW_S
    while time.monotonic() < until:
        try:
            other, ok, data = results.get(timeout=max(until - time.monotonic(), 0.01))
        except queue_module.Empty:
            break
        if not ok and other not in failures:
            failures[other] = data
    for other, process in enumerate(processes):
        if other not in failures and process.exitcode not in (None, 0):
            return _crash(
                other, world_size, process.exitcode, f" (then ranks {sorted(failures)} failed)"
            )
    first = min(failures, key=lambda r: failures[r][0])
    others = sorted(r for r in failures if r != first)
    also = f" (then ranks {others} failed too)" if others else ""
    return WorkerFailedError(
        f"rank {first} of {world_size} raised{also}:\n{failures[first][1]}", rank=first
    )


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 60.0,
    backend: Literal["gloo", "nccl"] | None = "gloo",
    start_method: StartMethod = "fork",
    threads_per_rank: int | None = 1,
    preload: Sequence[str] = DEFAULT_PRELOAD,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    ``backend=None`` creates no process group; with ``"nccl"`` rank r uses
    ``cuda:r % device_count``. ``fork`` (the default) starts ranks from this already-warm
    process; ``spawn`` and ``forkserver`` need ``fn`` importable by module name, and
    ``forkserver`` imports ``preload`` once in its server. ``threads_per_rank=None`` leaves
    torch's thread count alone; with ``fork`` from a process whose torch already ran parallel
    kernels, a child computing on several threads can hang in the inherited OpenMP pool, so
    keep a thread count or start with ``forkserver`` there. ``collective_timeout_s`` bounds one collective (the process
    group's timeout; default ``timeout_s``), so a rank left waiting on a hung peer fails long
    before the whole group's deadline. Results must be picklable. Raises ``WorkerTimeoutError``,
    ``WorkerCrashedError`` or ``WorkerFailedError`` (naming the rank) after killing every rank;
    a timeout's message carries each hung rank's Python stacks (asked for with ``SIGUSR1`` just
    before the kill), so a hang in CI says where it hung, and, for ``fork``, names the
    torch.distributed threads (a TCPStore's, gloo's) that were running here when the ranks forked.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    if not timeout_s > 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    if backend not in ("gloo", "nccl", None):
        raise ConfigError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if start_method == "fork":
        # Warm up once here so that forked ranks inherit torch instead of importing it each.
        import torch.distributed  # noqa: F401

    context: Any = multiprocessing.get_context(start_method)
    if start_method == "forkserver" and preload:
        context.set_forkserver_preload(list(preload))
    results: Any = context.Queue()
    port = free_port()
    pg_timeout_s = timeout_s if collective_timeout_s is None else collective_timeout_s
    if not pg_timeout_s > 0:
        raise ConfigError(f"collective_timeout_s must be positive, got {pg_timeout_s}")
    stacks_dir = tempfile.mkdtemp(prefix="posttrain-ranks-")
    worker_args = (backend, tuple(args), results, threads_per_rank, pg_timeout_s, stacks_dir)
    processes = [
        context.Process(
            target=_worker_main,
            args=(fn, rank, world_size, port, *worker_args),
            name=f"posttrain-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    hazards = _fork_hazards() if start_method == "fork" else []
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    exited_at: dict[int, float] = {}
    try:
        for process in processes:
            process.start()
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                stacks = _hung_stacks(processes, missing, stacks_dir)
                forked = (
                    f"; forked from a process with torch.distributed threads running "
                    f"({', '.join(hazards)}), which a forked rank can hang on: start the ranks "
                    "with spawn or forkserver"
                    if hazards
                    else ""
                )
                raise WorkerTimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout_s:g} s "
                    f"(hung or waiting on a hung peer){forked}; killed the group\n{stacks}",
                    rank=missing[0],
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.1))
            except queue_module.Empty:
                now = time.monotonic()
                for rank, process in enumerate(processes):
                    if rank in collected or process.is_alive():
                        continue
                    # A clean exit may still have its result in flight through the queue.
                    exited_at.setdefault(rank, now)
                    waited = now - exited_at[rank]
                    if (process.exitcode != 0 and waited > 1.0) or waited > 5.0:
                        raise _crash(rank, world_size, process.exitcode) from None
                continue
            if not ok:
                raise _first_failure(results, processes, rank, payload)
            collected[rank] = pickle.loads(payload)
        for process in processes:
            process.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        _kill_all(processes)
        results.close()
        results.join_thread()
        shutil.rmtree(stacks_dir, ignore_errors=True)
    return [collected[rank] for rank in range(world_size)]
