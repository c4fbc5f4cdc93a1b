"""The ``posttrain`` CLI's consoles and exits, shared by ``cli.py`` and the ``_cli_*`` modules.

People's output goes through rich (stdout), logs and errors to stderr; an error ends the
command with exit code 2 and one red line, never a traceback.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
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


# The pip arguments (from a clone's root) that provide each module a local command starts or
# imports; a path package needs its workspace dependencies beside it (no index serves them).
_PROVIDERS = {
    "posttrain.formats": ("./packages/formats",),
    "sglang_router": ("sglang-router",),
    "posttrain.models": ("./packages/formats", "./packages/models"),
    "posttrain.local_engine": (
        "./packages/formats",
        "./packages/models",
        "./packages/local-engine",
    ),
    "posttrain.session_router": ("./packages/formats", "./packages/session-router"),
    "posttrain.grpo": ("./packages/grpo (with the packages packages/grpo/README.md lists)",),
}


def require(command: str, modules: Iterable[str]) -> None:
    """Fail with one line when a module ``command`` runs or imports is not installed (launch
    installs alone; the local stack's packages are the user's to add), naming what provides it."""
    import importlib.util

    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            missing.append(module)
    if missing:
        install = dict.fromkeys(arg for m in missing for arg in _PROVIDERS.get(m, (m,)))
        fail(
            ModuleNotFoundError(
                f"{command} needs {', '.join(missing)}, not installed here; from the root of a "
                f"clone: pip install {' '.join(install)}"
            )
        )


def fail_with_logs(exc: Exception, kept: Iterable[str] | None) -> NoReturn:
    """Fail, first showing the last process log lines kept (when they were not streamed)."""
    if kept:
        err.print(Text("\n".join(kept)))
    fail(exc)


def interrupted() -> NoReturn:
    """After Ctrl-C (or SIGTERM): every started process has been stopped; exit 130."""
    err.print("interrupted; stopped every process")
    raise typer.Exit(code=130)


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler: stop like Ctrl-C does (every started process is stopped)."""
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """Make SIGINT (Ctrl-C) and SIGTERM stop the command, every started process with it.

    SIGINT gets Python's own handler back even when this process inherited it *ignored* (as a
    child of ``nohup``, of a shell's background job, or of a parent that was inside C
    ``system()`` when it spawned us): Python leaves an inherited SIG_IGN in place, and a
    launcher that ignores Ctrl-C would leave its whole stack running.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_interrupt)
