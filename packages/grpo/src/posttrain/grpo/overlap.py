"""Where rank 0's step batches come from: made when the step asks (on-policy, the default), or,
with ``off_policy_overlap``, the next step's made while this step trains.

Off-policy overlap: right before step s trains, a worker thread starts step s+1's rollout,
reward and advantages on the weights the engines serve now (version v); the trainer steps
meanwhile; the loop waits for that rollout (``wait``) *before* the weight sync, so no engine
changes weights under a turn in flight, and step s+1 then trains, at version v+1, on samples
drawn at v: exactly one version stale (``rollout_staleness`` 1 in the metrics; 0 at the first
step, whose rollout nothing overlapped). The loss weights each token by the truncated ratio of
the trainer's recompute to the engine's logprob (``--tis``, required with the flag), and
``train_rollout_logprob_abs_diff`` measures that gap instead of being 0. Every rollout of such
a run goes through the one worker thread, so the rollout client's event loop lives in one thread.

A checkpoint records the first prompt not yet trained (``data_position``): the prompts of a
rollout already taken for the next step are rolled out again after a resume, on-policy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Batch = dict[str, Any]  # a step's batch (a failure to make one is raised by ``get``)
MakeBatch = Callable[[int, int], Batch]  # (step, weight version) -> batch


class StepBatches:
    """Rank 0's step batches, made by ``make(step, version)``; ``get`` raises what it raised."""

    def __init__(self, make: MakeBatch, *, overlap: bool, steps: int) -> None:
        self._make = make
        self._steps = steps
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout") if overlap else None
        self._pending: tuple[int, int, int, Future[Batch]] | None = None  # step, version, position

    @property
    def overlap(self) -> bool:
        return self._pool is not None

    def get(self, step: int, version: int) -> Batch:
        """Step ``step``'s batch for a trainer at ``version``: the one started for it, else made now."""
        if self._pool is None:
            return self._make(step, version)
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            made_at, batch = pending[1], pending[3].result()
        else:
            made_at, batch = version, self._pool.submit(self._make, step, version).result()
        batch["stats"]["rollout_staleness"] = float(version - made_at)
        return batch

    def start_next(self, step: int, version: int, position: int) -> None:
        """Overlap only: start step ``step + 1``'s batch on the weights at ``version``
        (``position``: the prompt stream's position before it takes that step's prompts)."""
        if self._pool is not None and step + 1 < self._steps:
            future = self._pool.submit(self._make, step + 1, version)
            self._pending = (step + 1, version, position, future)

    def wait(self) -> float:
        """Block until the started batch is made (before the weights change); seconds waited."""
        t0 = time.perf_counter()
        if self._pending is not None:
            self._pending[3].exception()  # waits; an error is raised by the next ``get``
        return time.perf_counter() - t0

    def data_position(self, position: int) -> int:
        """The first prompt not yet trained, given the stream's ``position``."""
        return self._pending[2] if self._pending is not None else position

    def close(self) -> None:
        """Wait for a batch in flight and stop the worker thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
