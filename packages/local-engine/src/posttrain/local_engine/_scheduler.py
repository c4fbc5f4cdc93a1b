"""An async front over a synchronous batch runner: bounded queue, batching, pause.

Requests are queued as *items* (one prompt each; a batched /generate submits
several). One worker coroutine takes the oldest item, gathers queued items in
order up to ``max_batch`` whose batch keys (adapters) stay within ``max_keys``
distinct non-None values (SGLang's ``--max-loras-per-batch``), and runs them
together on a single dedicated thread, so torch never runs two batches at once
and the event loop stays free for health checks. A submit that would push the
queue past ``max_queue`` items fails at once with OverloadedError (HTTP 503)
rather than waiting: a client that sees 503 backs off, a hang helps nobody.

Batching here amortises the hop to the worker thread and the weight-lock; the
strict-numerics forward is batch-invariant, so batching never changes a token.

With ``run_stream`` (the engine's continuous batching) the batch stays open: between two
decode steps the worker thread asks ``admit(free_rows)`` for more queued items (the same
order and adapter rule, against the adapters already running) and each item's result is
delivered as it finishes, not when the batch ends. Admission stops while the scheduler is
paused or a ``call_exclusive`` (a weight swap) waits, so the batch drains and the swap runs
between batches as before. ``_pending`` is shared with the worker thread under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from posttrain.local_engine._errors import OverloadedError

__all__ = ["BatchScheduler"]

T = TypeVar("T")
R = TypeVar("R")
X = TypeVar("X")


@dataclass(slots=True)
class _Job(Generic[T, R]):
    item: T
    key: Hashable
    future: asyncio.Future[R]


StreamRunner = Callable[
    [
        Sequence[tuple[object, T]],
        Callable[[int], Sequence[tuple[object, T]]],
        Callable[[object, R | Exception], None],
        int,
    ],
    None,
]
"""``run_stream(first, admit, finish, rows)``: run ``first`` and whatever ``admit(free)`` hands
in, calling ``finish(handle, result)`` per item (an exception fails that item alone), in at
most ``rows`` concurrent items."""


class BatchScheduler(Generic[T, R]):
    """Runs ``run_batch(items) -> results`` for queued items on one worker thread."""

    def __init__(
        self,
        run_batch: Callable[[list[T]], list[R]],
        *,
        batch_key: Callable[[T], Hashable],
        abort_result: Callable[[T], R],
        max_queue: int = 256,
        max_batch: int = 8,
        max_keys: int = 8,
        run_stream: StreamRunner[T, R] | None = None,
    ) -> None:
        self._run_batch = run_batch
        self._run_stream = run_stream
        self._lock = threading.Lock()
        self._exclusive_waiting = 0
        self._batch_key = batch_key
        self._abort_result = abort_result
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_keys = max_keys
        self._pending: deque[_Job[T, R]] = deque()
        self._wakeup = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-engine")
        self._task: asyncio.Task[None] | None = None
        self.in_flight = 0

    @property
    def queued(self) -> int:
        """Items waiting (not yet running)."""
        return len(self._pending)

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._worker())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for job in self._pending:
            if not job.future.done():
                job.future.set_exception(OverloadedError("engine shutting down"))
        self._pending.clear()
        self._pool.shutdown(wait=True)

    async def submit(self, items: Sequence[T]) -> list[R]:
        """Queue the items and wait for all of their results (in order)."""
        if len(self._pending) + len(items) > self.max_queue:
            raise OverloadedError(
                f"request queue full: {len(self._pending)} queued + {len(items)} new > "
                f"max_queue {self.max_queue}"
            )
        loop = asyncio.get_running_loop()
        jobs = [_Job[T, R](it, self._batch_key(it), loop.create_future()) for it in items]
        with self._lock:
            self._pending.extend(jobs)
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(j.future for j in jobs)))
        finally:
            for j in jobs:  # a cancelled client leaves no orphan work queued
                if not j.future.done():
                    j.future.cancel()
                    with self._lock, contextlib.suppress(ValueError):
                        self._pending.remove(j)

    def pause(self, *, abort_queued: bool) -> int:
        """Stop taking new batches; with ``abort_queued`` finish queued items as aborted."""
        self._resumed.clear()
        n = 0
        if abort_queued:
            with self._lock:
                jobs, self._pending = list(self._pending), deque()
            for job in jobs:
                if not job.future.done():
                    job.future.set_result(self._abort_result(job.item))
                    n += 1
        return n

    def resume(self) -> None:
        self._resumed.set()
        self._wakeup.set()

    async def call_exclusive(self, fn: Callable[[], X]) -> X:
        """Run ``fn`` on the worker thread, between batches (for weight swaps)."""
        loop = asyncio.get_running_loop()
        self._exclusive_waiting += 1  # a running stream admits nothing more, so fn runs soon
        try:
            return await loop.run_in_executor(self._pool, fn)
        finally:
            self._exclusive_waiting -= 1

    def _take_batch(
        self, limit: int | None = None, running: Sequence[Hashable] = ()
    ) -> list[_Job[T, R]]:
        """Up to ``limit`` (default ``max_batch``) queued jobs in order whose keys fit the
        adapter limit together with the ``running`` keys; the others stay queued."""
        limit = self.max_batch if limit is None else limit
        with self._lock:
            return self._take_locked(limit, set(running))

    def _take_locked(self, limit: int, keys: set[Hashable]) -> list[_Job[T, R]]:
        batch: list[_Job[T, R]] = []
        rest: deque[_Job[T, R]] = deque()
        while self._pending and len(batch) < limit:
            job = self._pending.popleft()
            if job.future.done():
                continue
            # a None key (no adapter) never counts against the limit
            if job.key in keys or job.key is None or len(keys - {None}) < self.max_keys:
                keys.add(job.key)
                batch.append(job)
            else:
                rest.append(job)
        rest.extend(self._pending)
        self._pending = rest
        return batch

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._resumed.wait()
            await self._let_arrivals_queue()
            if self.paused:  # paused while the arrivals queued
                continue
            batch = self._take_batch()
            if not batch:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self.in_flight = len(batch)
            if self._run_stream is not None:
                await self._stream(loop, self._run_stream, batch)
                continue
            items = [j.item for j in batch]
            try:
                results = await loop.run_in_executor(self._pool, self._run_batch, items)
            except Exception as e:  # one bad batch fails its own requests, not the worker
                for j in batch:
                    if not j.future.done():
                        j.future.set_exception(e)
            else:
                for j, r in zip(batch, results, strict=True):
                    if not j.future.done():
                        j.future.set_result(r)
            finally:
                self.in_flight = 0

    async def _let_arrivals_queue(self) -> None:
        """Before a batch starts, give the event loop a few turns so that requests already
        received reach the queue and start together (a rollout step's requests arrive within
        a few milliseconds); it stops at the first turns that queue nothing, so a lone request
        waits only a few loop turns."""
        idle, seen = 0, len(self._pending)
        for _ in range(64):
            await asyncio.sleep(0)
            idle = idle + 1 if len(self._pending) == seen else 0
            seen = len(self._pending)
            if idle >= 3:
                return

    async def _stream(
        self,
        loop: asyncio.AbstractEventLoop,
        run_stream: StreamRunner[T, R],
        batch: list[_Job[T, R]],
    ) -> None:
        """One continuous batch on the worker thread; results are delivered as items finish."""
        running: dict[object, _Job[T, R]] = {id(j): j for j in batch}

        def admit(free: int) -> list[tuple[object, T]]:  # worker thread, between steps
            if self._exclusive_waiting or not self._resumed.is_set():
                return []
            jobs = self._take_batch(free, [j.key for j in running.values()])
            running.update((id(j), j) for j in jobs)
            self.in_flight = len(running)
            return [(id(j), j.item) for j in jobs]

        def finish(handle: object, result: R | Exception) -> None:  # worker thread
            job = running.pop(handle)
            self.in_flight = len(running)
            loop.call_soon_threadsafe(_resolve, job.future, result)

        first = [(id(j), j.item) for j in batch]
        try:
            await loop.run_in_executor(self._pool, run_stream, first, admit, finish, self.max_batch)
        except Exception as e:  # a failed batch fails the requests it holds, not the worker
            for j in running.values():
                if not j.future.done():
                    j.future.set_exception(e)
        finally:
            self.in_flight = 0


def _resolve(future: asyncio.Future[R], result: R | Exception) -> None:
    if future.done():
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
