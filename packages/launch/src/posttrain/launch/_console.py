"""The ``posttrain`` CLI's consoles and exits, shared by ``cli.py`` and ``_cli_stack.py``.

People's output goes through rich (stdout), logs and errors to stderr; an error ends the
command with exit code 2 and one red line, never a traceback.
"""

from __future__ import annotations

from types import FrameType
from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(exc: Exception) -> NoReturn:
    # Text, not markup: messages hold brackets ("[0]*1+[1]*46") rich would eat as tags.
    err.print(Text.assemble(("error: ", "red"), str(exc)))
    raise typer.Exit(code=2)


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler: stop like Ctrl-C does (every started process is stopped)."""
    raise KeyboardInterrupt
