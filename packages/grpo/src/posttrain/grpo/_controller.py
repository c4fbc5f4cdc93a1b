"""Rank 0 decides, every rank learns: ``run_on_rank0``.

Rank 0 is the run's controller: it talks HTTP (rollouts, rewards, the teacher, the engines'
weight routes, sgl-router) and reads the user's files, and the other trainer ranks need what it
found to take the same path through the next collective. ``run_on_rank0(compute, group=...)``
calls ``compute()`` on the group's rank 0 alone and broadcasts the outcome over ``group``: every
rank returns the value, or every rank raises an exception of the same type with the same
message. Rank 0 raises the original (its traceback and cause included), the others a copy, so no
rank is left waiting for a broadcast that never comes and no rank reports an error of its own
making.

How a copy crosses: the exception pickled as it is, when that round-trips (same type, same
``str``); else its class, ``args`` and attributes, rebuilt without calling ``__init__`` (for an
exception whose ``__init__`` takes other arguments than its ``args``, such as
``PreflightError(failures)``); else, when neither can cross (a class defined inside a function,
an attribute that does not pickle), a ``GrpoRunError`` naming rank 0, the type and the message.
Only ``Exception``s are carried; a ``KeyboardInterrupt`` on rank 0 stops rank 0, and the others
give up at the group's timeout.

With one rank, or no process group at all, it is ``compute()`` itself: the same value or the
same exception, with no broadcast.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch.distributed as dist

from posttrain.grpo._errors import GrpoRunError

__all__ = ["run_on_rank0"]

T = TypeVar("T")


def run_on_rank0(compute: Callable[[], T], *, group: dist.ProcessGroup | None) -> T:
    """``compute()`` on rank 0 of ``group`` (``None``: the default group); on every rank of it,
    that value, or an exception of the type and message ``compute`` raised there.

    Collective: every rank of ``group`` calls it, in the same order as its other collectives.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return compute()
    raised: Exception | None = None
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = _Outcome(value=compute())
        except Exception as exc:
            raised = exc
            box[0] = _Outcome(error=_portable(exc))
    dist.broadcast_object_list(box, group=group, group_src=0)
    if raised is not None:
        raise raised
    outcome = cast(_Outcome, box[0])
    if outcome.error is not None:
        raise outcome.error.restore()
    return cast(T, outcome.value)


@dataclass(frozen=True, slots=True)
class _Rebuilt:
    """An exception as its class, ``args`` and attributes; ``restore`` skips ``__init__``."""

    cls: type[Exception]
    args: tuple[Any, ...]
    state: dict[str, Any] = field(default_factory=dict)

    def restore(self) -> Exception:
        exc = self.cls.__new__(self.cls, *self.args)
        exc.args = self.args
        exc.__dict__.update(self.state)
        return exc


@dataclass(frozen=True, slots=True)
class _Pickled:
    """An exception that pickles and unpickles as itself."""

    exc: Exception

    def restore(self) -> Exception:
        return self.exc


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What rank 0 broadcasts: ``compute``'s value, or its exception in a form that crosses."""

    value: Any = None
    error: _Pickled | _Rebuilt | None = None


def _portable(exc: Exception) -> _Pickled | _Rebuilt:
    """``exc`` in the first form that crosses a pickle as the same type with the same message."""
    candidates: list[Callable[[], _Pickled | _Rebuilt]] = [
        lambda: _Pickled(exc),
        lambda: _Rebuilt(type(exc), tuple(exc.args), dict(getattr(exc, "__dict__", {}))),
    ]
    for candidate in candidates:
        try:
            form = candidate()
            copy = pickle.loads(pickle.dumps(form)).restore()
        except Exception:  # it does not cross in this form: try the next
            continue
        if type(copy) is type(exc) and str(copy) == str(exc):
            return form
    return _Rebuilt(GrpoRunError, (f"rank 0: {type(exc).__name__}: {exc}",))
