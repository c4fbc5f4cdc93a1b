"""Gradient accumulation that runs the HSDP replicate all-reduce once per optimizer step.

By default FSDP2 reduce-scatters over ``dp_shard`` *and* all-reduces over ``dp_replicate`` after
every backward, so M micro-batches cost M cross-replica (usually cross-node) all-reduces. Inside
``accumulate_gradients(model, M)`` the all-reduce is switched off
(``set_requires_all_reduce(False)``) for micro-batches 0..M-2: FSDP keeps adding the
reduce-scattered shards locally and all-reduces the sum once, in micro-batch M-1. Gradients are
the same (up to fp32 summation order); replicate traffic drops M-fold. The reduce-scatter still
runs per micro-batch, so unsharded gradients never pile up.

Departure: the count is enforced. Leaving the context after fewer micro-batches than declared
would leave the replicas' gradients un-synchronised (silently divergent weights), so it raises
``AccumulationError``; so does a micro-batch beyond the declared count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from torch import nn

from posttrain.fsdp_mesh._errors import AccumulationError, MeshConfigError
from posttrain.fsdp_mesh._hsdp import fsdp_modules


class GradientAccumulation:
    """Context manager returned by ``accumulate_gradients``; see the module docstring."""

    def __init__(self, model: nn.Module, num_micro_batches: int, *, defer: bool = True) -> None:
        if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int):
            raise MeshConfigError(f"num_micro_batches must be an int, got {num_micro_batches!r}")
        if num_micro_batches < 1:
            raise MeshConfigError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
        self._modules = fsdp_modules(model)
        if not self._modules:
            raise MeshConfigError(f"{type(model).__name__} has no FSDP-sharded modules")
        self.num_micro_batches = num_micro_batches
        self.defer = defer
        self.completed = 0
        self._active = False

    def _set_all_reduce(self, flag: bool) -> None:
        for m in self._modules:
            m.set_requires_all_reduce(flag, recurse=False)

    def __enter__(self) -> GradientAccumulation:
        if self._active:
            raise AccumulationError("accumulate_gradients context entered twice")
        self._active = True
        self.completed = 0
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._active = False
        self._set_all_reduce(True)
        if exc_type is None and self.completed != self.num_micro_batches:
            raise AccumulationError(
                f"left gradient accumulation after {self.completed} of "
                f"{self.num_micro_batches} micro-batches: the replicate all-reduce never ran"
            )

    @property
    def is_last(self) -> bool:
        """Whether the next (or current) micro-batch is the last of the step."""
        return self.completed == self.num_micro_batches - 1

    @contextmanager
    def micro_batch(self) -> Iterator[int]:
        """Wrap one micro-batch's forward and backward; yields its index."""
        if not self._active:
            raise AccumulationError("micro_batch() used outside its accumulate_gradients context")
        if self.completed >= self.num_micro_batches:
            raise AccumulationError(
                f"micro-batch {self.completed + 1} exceeds the declared "
                f"num_micro_batches={self.num_micro_batches}"
            )
        self._set_all_reduce(self.is_last or not self.defer)
        yield self.completed
        self.completed += 1


def accumulate_gradients(
    model: nn.Module, num_micro_batches: int, *, defer: bool = True
) -> GradientAccumulation:
    """Accumulate ``num_micro_batches`` backwards; with ``defer`` one replicate all-reduce per step.

    ``defer=False`` keeps FSDP2's default (an all-reduce per micro-batch) with the same
    bookkeeping, for comparisons.
    """
    return GradientAccumulation(model, num_micro_batches, defer=defer)
