"""The API key of one local stack: generated per stack, stored 0600, removed when it stops.

``posttrain up`` and ``posttrain demo`` give every component that takes a key the same random
one: each local engine (``--api-key`` guards its state-changing routes: weights, adapters,
pause, flush) and the session router (``--api-key`` guards every route). The key is written to
a file only its owner can read, in a 0700 directory of the user's (``$XDG_RUNTIME_DIR/posttrain``
where that exists, else ``<tmp>/posttrain-<uid>``), and the CLI prints that path, never the key.

Departures, both because of what the other side accepts today:

- sgl-router gets no key: with ``--api-key`` it answers 401 to ``/generate`` and ``/workers``
  without the bearer, and the session router sends none upstream (it would also take the 401
  of ``GET /workers`` for "not a router" and skip its passthrough probe). The router binds
  127.0.0.1 only.
- SGLang engines get no key: SGLang's ``--api-key`` guards every route, generation included,
  and the router in front does not send one.

The key reaches the children by file, never argv: local engines and the session router get
``--api-key-file <this file>`` (``posttrain.formats.resolve_api_key`` reads it; without a file
a stack passes ``$POSTTRAIN_API_KEY`` in their environment, which only their owner can read),
so ``ps`` and ``/proc/<pid>/cmdline`` show the path, not the key.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path

from posttrain.launch._errors import LaunchConfigError

__all__ = ["key_dir", "new_api_key", "remove_key_file", "write_key_file"]


def new_api_key() -> str:
    """A fresh random key: 256 bits in hex (a URL-safe key may start with "-", which argparse
    would take for a flag)."""
    return secrets.token_hex(32)


def key_dir() -> Path:
    """The user's private directory for stack keys (created 0700; refused if others can enter)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        path = Path(runtime) / "posttrain"
    else:
        path = Path(tempfile.gettempdir()) / f"posttrain-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise LaunchConfigError(f"key directory {path} is not a directory owned by this user")
    if info.st_mode & 0o077:
        raise LaunchConfigError(
            f"key directory {path} is open to other users (mode {oct(info.st_mode & 0o777)}); "
            "chmod 700 it or remove it"
        )
    return path


def write_key_file(key: str, name: str, directory: Path | None = None) -> Path:
    """Write ``key`` to ``<directory>/<name>.key`` with mode 0600 (created, never overwritten)."""
    folder = directory if directory is not None else key_dir()
    path = folder / f"{name}.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise LaunchConfigError(f"key file {path} already exists; stop that stack first") from None
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(key + "\n")
    return path


def remove_key_file(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
