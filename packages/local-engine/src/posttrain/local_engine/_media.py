"""Media decoding in its own bounded pool, away from the event loop and the weight routes.

A request naming media (``image_data`` / ``audio_data``, as the parsed body has them, never
a key looked for in raw bytes) is prepared here: its references read under the engine's
``MediaFiles`` policy (``--allowed-media-dir``, ``--max-media-bytes``, ``--media-timeout-s``)
and decoded on one of ``--media-workers`` threads. The weight routes and large-body parsing
use asyncio's default pool, so media that stalls (a slow file, a huge image) cannot take
them down. Capacity: ``workers`` running plus ``4 x workers`` waiting; past that a request is
503 at once. A decode that outlives the deadline gets a 400 (its thread keeps its slot until
it really ends, so stuck work shows as a full pool, never as unbounded threads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from posttrain.interface import WireFormatError
from posttrain.local_engine._errors import OverloadedError
from posttrain.models import MediaFiles

__all__ = ["MediaPool"]

X = TypeVar("X")
_WAITING_PER_WORKER = 4


class MediaPool:
    """``workers`` threads for media work, a bound on what may wait, a per-request deadline."""

    def __init__(self, files: MediaFiles, *, workers: int, timeout_s: float) -> None:
        self.files = files
        self.timeout_s = timeout_s
        self._limit = workers * (1 + _WAITING_PER_WORKER)
        self._pending = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="media")

    @property
    def pending(self) -> int:
        """Media jobs submitted and not finished (running or waiting)."""
        return self._pending

    def _done(self, _: Future[X]) -> None:
        self._pending -= 1  # GIL-atomic enough: only a gauge, bounded by _limit

    async def run(self, work: Callable[[], X], *, field: str) -> X:
        """Run ``work`` in the pool; 503 when it is full, a 400 naming ``field`` past the
        deadline."""
        if self._pending >= self._limit:
            raise OverloadedError(
                f"{field}: media decoding is at capacity ({self._pending} requests in flight); "
                "retry later"
            )
        self._pending += 1
        future = self._pool.submit(work)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout=self.timeout_s)
        except TimeoutError:
            raise WireFormatError(
                f"{field}: media decoding took longer than {self.timeout_s:g} s "
                "(--media-timeout-s); refused",
                field=field,
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
