"""Where a component's bearer token comes from: a file or the environment, never argv.

A key on the command line is readable by every user of the machine (``/proc/<pid>/cmdline``,
``ps``). ``resolve_api_key`` is the one reader every component uses: the file a
``--api-key-file`` flag names (one token, whitespace around it ignored), else
``$POSTTRAIN_API_KEY``, else None (no key). A file that cannot be read, is empty or holds more
than one token is a ``FormatsConfigError`` naming the flag; the message never holds the key.
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.formats._errors import FormatsConfigError

__all__ = ["API_KEY_ENV", "resolve_api_key"]

API_KEY_ENV = "POSTTRAIN_API_KEY"


def resolve_api_key(
    key_file: str | os.PathLike[str] | None, *, flag: str = "--api-key-file"
) -> str | None:
    """The bearer token from ``key_file``, else ``$POSTTRAIN_API_KEY``, else None."""
    if key_file is None:
        env = os.environ.get(API_KEY_ENV, "").strip()
        if env and len(env.split()) != 1:
            raise FormatsConfigError(f"${API_KEY_ENV} must hold one token (no spaces)")
        return env or None
    path = Path(key_file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise FormatsConfigError(f"{flag} {str(path)!r}: cannot be read ({why})") from None
    parts = text.split()
    if len(parts) != 1:
        raise FormatsConfigError(f"{flag} {str(path)!r}: must hold exactly one token")
    return parts[0]
