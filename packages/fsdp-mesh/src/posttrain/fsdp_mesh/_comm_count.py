"""Count the collectives a block of code issues: calls and bytes per (op, process group).

``count_collectives()`` is a ``TorchDispatchMode`` that sees every c10d collective op
(``allreduce_``, ``_reduce_scatter_base_``, ``_allgather_base_``, ...) that passes through the
dispatcher on this thread, whatever Python wrapper issued it, and records the call, the bytes of
its full buffer (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the
unreduced input, as in nccl-tests) and the ranks of its process group. It is how the tests and benchmark show the
deferred replicate all-reduce (one per step instead of one per micro-batch).

Departure from ``torch.distributed.tensor.debug.CommDebugMode``: that counts calls per op only;
here each record keeps bytes and group ranks, so replicate and shard traffic are told apart.
Autograd runs CPU backward on the calling thread, so FSDP's backward collectives are seen on CPU;
on CUDA they are also dispatched from the thread that calls ``backward``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_C10D_OPS = frozenset(
    {
        "_allgather_base_",
        "_reduce_scatter_base_",
        "allgather_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "allreduce_",
        "allreduce_coalesced_",
        "alltoall_",
        "alltoall_base_",
        "broadcast_",
        "gather_",
        "scatter_",
        "reduce_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
    }
)

_INPUT_IS_FULL = frozenset(
    {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"}
)


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One collective: op name, ranks of its group, bytes of its full (unsharded) buffer."""

    op: str
    group_ranks: tuple[int, ...]
    nbytes: int


@dataclass(slots=True)
class CollectiveLog:
    """The calls recorded by ``count_collectives``, with summaries."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def count(self, op: str | None = None, *, group_ranks: tuple[int, ...] | None = None) -> int:
        return len(self._select(op, group_ranks))

    def nbytes(self, op: str | None = None, *, group_ranks: tuple[int, ...] | None = None) -> int:
        return sum(c.nbytes for c in self._select(op, group_ranks))

    def by_op(self) -> dict[str, int]:
        return dict(Counter(c.op for c in self.calls))

    def _select(self, op: str | None, group_ranks: tuple[int, ...] | None) -> list[CollectiveCall]:
        return [
            c
            for c in self.calls
            if (op is None or c.op == op) and (group_ranks is None or c.group_ranks == group_ranks)
        ]


def _group_ranks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(leaf)
            except (RuntimeError, TypeError):
                continue
            return tuple(dist.get_process_group_ranks(pg))
        if isinstance(leaf, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(leaf))
    return ()


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.log = log

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if getattr(packet, "_qualified_op_name", "").startswith("c10d::"):
            name = packet.__name__
            if name in _C10D_OPS:
                # The collective's full buffer: the input of a reduce-scatter, the output of an
                # all-gather, the tensor of an all-reduce (nccl-tests' "size").
                buffer = args[1] if name in _INPUT_IS_FULL and len(args) > 1 else args[:1]
                leaves = tree_leaves(buffer)
                nbytes = sum(
                    t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
                )
                self.log.calls.append(
                    CollectiveCall(op=name, group_ranks=_group_ranks(args, kwargs), nbytes=nbytes)
                )
        return func(*args, **kwargs)


class count_collectives:  # noqa: N801 - used like a function: `with count_collectives() as log`
    """Context manager recording every c10d collective issued on this thread."""

    def __init__(self) -> None:
        self.log = CollectiveLog()
        self._mode = _Recorder(self.log)

    def __enter__(self) -> CollectiveLog:
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self.log

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
