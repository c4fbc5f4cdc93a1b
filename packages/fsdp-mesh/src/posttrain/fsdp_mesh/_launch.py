"""Run a function on W local ranks with a process group each, failing cleanly on a crash or hang.

``launch_workers(fn, world_size, timeout_s=...)`` starts W processes, initialises
``torch.distributed`` in each (``backend`` gloo or nccl; with nccl rank g uses
``cuda:g % device_count``), calls ``fn(rank, world_size, *args)`` and returns the per-rank results.
It backs the parity command's self-spawn mode and the package's multi-process tests (same call
shape as ``posttrain.interface.testing.run_workers``).

Departures from ``torch.multiprocessing.spawn``:

* A deadline on the whole group: when it passes, every rank still alive is killed by pid and
  ``WorkerTimeoutError`` names the ranks that had not finished. A rank that raises or dies makes
  the parent kill the others at once (they would otherwise wait in a collective) and raise
  ``WorkerError`` naming that rank, with its traceback.
* Results cross the queue as plain pickles (tensors by value, no shared-memory handles that die
  with the worker).
* ``start_method="forkserver"`` with ``preload`` imports torch once in the fork server, so later
  groups start in well under a second instead of one torch import per rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from posttrain.fsdp_mesh._errors import MeshConfigError, WorkerError, WorkerTimeoutError

StartMethod = Literal["spawn", "forkserver", "fork"]
DEFAULT_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.optim",
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device_id)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        try:
            out = fn(rank, world_size, *args)
        except BaseException:
            # Report before tearing the group down: the teardown makes peers fail too, and the
            # parent names the rank whose failure came first.
            results.put((rank, False, (time.time(), traceback.format_exc())))
            raise
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, (time.time(), traceback.format_exc())))
        raise SystemExit(1) from None


def _raise_first_failure(
    results: Any, procs: Sequence[BaseProcess], rank: int, payload: tuple[float, str]
) -> None:
    """Collect failures for a moment and raise for the rank that failed first.

    A rank that died without a report (killed, ``os._exit``) is the cause before any rank that
    raised: the others' errors are then "connection reset by peer" from its death.
    """
    failures = {rank: payload}
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        try:
            other, ok, data = results.get(timeout=max(until - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if not ok and other not in failures:
            failures[other] = data
    for r, p in enumerate(procs):
        if r not in failures and p.exitcode is not None and p.exitcode != 0:
            raise WorkerError(
                f"rank {r} exited with code {p.exitcode} before returning a result "
                f"(then ranks {sorted(failures)} failed)",
                rank=r,
            )
    first = min(failures, key=lambda r: failures[r][0])
    others = sorted(r for r in failures if r != first)
    also = f" (then ranks {others} failed too)" if others else ""
    raise WorkerError(f"rank {first} raised{also}:\n{failures[first][1]}", rank=first)


def _kill(procs: Sequence[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def launch_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout_s: float,
    backend: str = "gloo",
    args: tuple[Any, ...] = (),
    start_method: StartMethod = "spawn",
    preload: Sequence[str] = DEFAULT_PRELOAD,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; results by rank."""
    if world_size < 1:
        raise MeshConfigError(f"world_size must be at least 1, got {world_size}")
    if not timeout_s > 0:
        raise MeshConfigError(f"timeout_s must be positive, got {timeout_s}")
    if backend not in ("gloo", "nccl"):
        raise MeshConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    results = ctx.Queue()
    port = free_port()
    procs: list[BaseProcess] = []
    deadline = time.monotonic() + timeout_s
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, backend, timeout_s, fn, args, results),
                name=f"posttrain-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        done: dict[int, Any] = {}
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(world_size) if r not in done]
                raise WorkerTimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s "
                    "(hung or waiting on a hung peer); killed the group",
                    rank=missing[0],
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode is not None and p.exitcode != 0:
                        raise WorkerError(
                            f"rank {r} exited with code {p.exitcode} before returning a result",
                            rank=r,
                        ) from None
                continue
            if not ok:
                _raise_first_failure(results, procs, rank, payload)
            done[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
        return [done[r] for r in range(world_size)]
    finally:
        _kill(procs)
        results.close()
        results.join_thread()
