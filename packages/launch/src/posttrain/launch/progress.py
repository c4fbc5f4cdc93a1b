"""What a stack is doing, as it does it: one rich progress line per step, with elapsed time.

``posttrain up`` and ``posttrain demo`` spend most of their time waiting (a checkpoint written,
engines loading, a router probed, chat turns generated). ``StackProgress`` shows each step as a
spinner that turns into a tick and its duration, on stderr, so stdout stays for machine output.
``LocalRunner`` reports its processes through ``on_event`` (``starting`` -> ``ready``); the
demo adds its own steps with ``step()``. On a terminal it is a live display; elsewhere (CI, a
pipe) rich prints each finished line once. A step that raises, and any step still open when
the display closes (a process that never got ready), ends with a red cross, never a tick: its
spinner is taken off the display and a "failed" line printed instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Self

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn
from rich.text import Text

__all__ = ["StackProgress"]


class StackProgress:
    """A live list of steps; use as a context manager around the work."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]✓[/]"),
            TextColumn("{task.description}"),
            TextColumn("[dim]{task.fields[took]}"),
            console=console,
            transient=False,
        )
        self._tasks: dict[str, tuple[TaskID, float, str]] = {}  # key: (task, start, description)

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        outcome = "interrupted" if kind is KeyboardInterrupt else "did not finish"
        for key in list(self._tasks):
            self.fail(key, outcome)
        self._progress.stop()

    def begin(self, key: str, description: str) -> None:
        task = self._progress.add_task(description, total=1, took="")
        self._tasks[key] = (task, time.monotonic(), description)

    def end(self, key: str, description: str | None = None) -> None:
        if key not in self._tasks:
            return
        task, start, _ = self._tasks.pop(key)
        took = f"{time.monotonic() - start:.1f} s"
        if description is None:
            self._progress.update(task, completed=1, took=took)
        else:
            self._progress.update(task, completed=1, took=took, description=description)

    def fail(self, key: str, outcome: str = "failed") -> None:
        """End an open step without a tick: its spinner leaves, a red-cross line stays."""
        if key not in self._tasks:
            return
        task, start, description = self._tasks.pop(key)
        self._progress.remove_task(task)
        took = f"{time.monotonic() - start:.1f} s"
        line = Text.assemble(("✗ ", "red"), description, (f" {outcome} ", "red"), (took, "dim"))
        self._progress.console.print(line)

    @contextmanager
    def step(self, description: str) -> Iterator[None]:
        """One step of the caller's own (a checkpoint written, a chat turn)."""
        self.begin(description, description)
        try:
            yield
        except BaseException as exc:
            self.fail(
                description, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            )
            raise
        self.end(description)

    def on_event(self, name: str, what: str) -> None:
        """``LocalRunner``'s events: a line per process from start to ready, one for the stop."""
        if what == "starting":
            self.begin(name, f"starting {name}")
        elif what == "ready":
            self.end(name, f"{name} ready")
        elif what == "registered":
            self.begin(f"reg {name}", f"registering {name} with the router")
            self.end(f"reg {name}")
        elif what == "stopping":
            self.begin("stop", "stopping every process")
        elif what == "stopped":
            self.end("stop", "stopped every process")
