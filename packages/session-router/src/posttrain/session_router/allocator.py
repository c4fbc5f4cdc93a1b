"""The session server's memory allocator: mimalloc by default, preloaded by re-executing the CLI once.

Why: HF ``tokenizers`` spends about a third of its time in glibc's malloc and free (``perf`` on a
512-token byte-level BPE encode). With mimalloc the same encode takes 0.25 instead of 0.44 ms in a
hot loop, and a cold first turn's tokenizing in the server drops from ~0.7 to ~0.45 ms
(``benchmarks/bench_session_router.py``; docs/benchmarks/session-router.md).

How: an allocator can only be replaced when a process starts (``LD_PRELOAD`` is read by the
dynamic loader at exec), so ``python -m posttrain.session_router`` checks before importing anything
heavy and, if mimalloc is wanted but not loaded, re-executes itself once (same pid, same command
line) with ``LD_PRELOAD`` naming the ``libmimalloc.so`` of the ``cmeel-mimalloc`` wheel. The
re-executed process restores the caller's ``LD_PRELOAD`` in its environment, so anything it starts
inherits the caller's setting, not ours. If the library cannot be preloaded the loader ignores it
and the server runs on the system allocator (``/health`` says which one is in use); a marker
variable guarantees at most one re-exec.

This module imports only the standard library: it runs before the package's heavy imports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

ALLOCATORS = ("mimalloc", "system")
DEFAULT_ALLOCATOR = "mimalloc"
# Set only in the re-executed process: "unset", or "set:" + the caller's LD_PRELOAD.
REEXEC_MARKER = "POSTTRAIN_SESSION_ROUTER_CALLER_LD_PRELOAD"


def mimalloc_library() -> Path | None:
    """``libmimalloc.so`` from the installed ``cmeel-mimalloc`` wheel, or None when it is absent."""
    try:
        dist = importlib.metadata.distribution("cmeel-mimalloc")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("cmeel.prefix/lib/libmimalloc.so")))
    return path if path.is_file() else None


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str:
    """``"mimalloc"`` when a mimalloc library is mapped into this process, else ``"system"``."""
    try:
        text = maps.read_text()
    except OSError:
        return "system"
    return "mimalloc" if "libmimalloc" in text else "system"


def preload_environment(library: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for the re-exec: ``library`` first in ``LD_PRELOAD``, the caller's value kept."""
    env = dict(environ)
    caller = environ.get("LD_PRELOAD")
    env[REEXEC_MARKER] = "unset" if caller is None else f"set:{caller}"
    env["LD_PRELOAD"] = f"{library} {caller}" if caller else str(library)
    return env


def restore_environment(environ: MutableMapping[str, str]) -> bool:
    """In the re-executed process, put the caller's ``LD_PRELOAD`` back; True if this is that process."""
    marker = environ.pop(REEXEC_MARKER, None)
    if marker is None:
        return False
    if marker.startswith("set:"):
        environ["LD_PRELOAD"] = marker[len("set:") :]
    else:
        environ.pop("LD_PRELOAD", None)
    return True


def requested_allocator(argv: Sequence[str]) -> str:
    """The ``--allocator`` value in a command line, read the way the CLI's parser reads it.

    Abbreviations (``--alloc system``) and ``--allocator=system`` count; a malformed value is left
    for the CLI's own parser to report.
    """
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--allocator", default=DEFAULT_ALLOCATOR)
    try:
        known, _ = parser.parse_known_args(list(argv))
    except argparse.ArgumentError:
        return DEFAULT_ALLOCATOR
    return str(known.allocator)


def reexec_with_allocator(allocator: str) -> None:
    """Re-execute this process with mimalloc preloaded when ``allocator`` asks for it (at most once).

    Returns without doing anything when the system allocator is asked for, mimalloc is already
    loaded, this process is the re-executed one, the platform is not Linux, the library is not
    installed, or its path cannot be written in ``LD_PRELOAD`` (a warning on stderr in the last
    three cases).
    """
    if restore_environment(os.environ):
        if allocator == "mimalloc" and loaded_allocator() != "mimalloc":
            print(
                "warning: mimalloc could not be preloaded; serving with the system allocator",
                file=sys.stderr,
            )
        return
    if allocator != "mimalloc" or loaded_allocator() == "mimalloc":
        return
    library = mimalloc_library() if sys.platform == "linux" else None
    if library is None:
        print(
            "warning: mimalloc is not available here (the cmeel-mimalloc wheel, Linux only); "
            "serving with the system allocator",
            file=sys.stderr,
        )
        return
    if any(sep in str(library) for sep in " :"):  # LD_PRELOAD splits on both
        print(
            f"warning: cannot preload {library}: LD_PRELOAD cannot name a path with a space or "
            "colon; serving with the system allocator",
            file=sys.stderr,
        )
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, preload_environment(library, os.environ))
