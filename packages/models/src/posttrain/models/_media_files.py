"""Which files a media reference may name, and reading one with a size cap and a deadline.

An engine takes media references from any client, so a path reference is a request to read a
file on the engine's disk. ``MediaFiles`` is the policy a decoder runs under:

* ``MediaFiles.engine(None)`` (an engine without ``--allowed-media-dir``): no path is ever
  looked at; a reference is a ``data:`` URL or base64, and one that is neither gets the same
  "not allowed" error whatever file it names, so the error tells nothing about the disk.
* ``MediaFiles.engine(DIR)``: a path inside ``DIR`` (absolute, or relative to it; ``..``
  refused lexically, before the disk is touched) is opened one component at a time from a
  descriptor of ``DIR`` with ``O_NOFOLLOW`` (a symlink anywhere is refused), ``O_NONBLOCK``
  (a FIFO cannot block the open), must be a regular file, and is read in chunks up to
  ``max_bytes`` and within ``timeout_s``. Any failure is the same "not allowed" error.
* ``MediaFiles.trusted()`` (the default of the library calls, for a trainer reading its own
  data set): any regular file, with the same size cap and deadline.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from posttrain.models._errors import MediaError

__all__ = ["DEFAULT_MEDIA_TIMEOUT_S", "MAX_MEDIA_FILE_BYTES", "MediaFiles", "read_media_file"]

MAX_MEDIA_FILE_BYTES = 64 << 20
"""The largest media file a path reference may name by default (read whole): 64 MiB."""
DEFAULT_MEDIA_TIMEOUT_S = 10.0
"""How long reading one media file may take by default."""
_MAX_PATH_CHARS = 4096
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaFiles:
    """The file-path policy of a media decoder (see the module doc)."""

    allowed_dir: Path | None = None
    any_path: bool = False
    max_bytes: int = MAX_MEDIA_FILE_BYTES
    timeout_s: float = DEFAULT_MEDIA_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise MediaError(f"max_media_bytes must be positive, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise MediaError(f"media_timeout_s must be positive, got {self.timeout_s}")

    @classmethod
    def trusted(cls) -> MediaFiles:
        """Any regular file (a trainer reading its own data), size cap and deadline kept."""
        return cls(any_path=True)

    @classmethod
    def engine(
        cls,
        allowed_dir: str | os.PathLike[str] | None,
        *,
        max_bytes: int = MAX_MEDIA_FILE_BYTES,
        timeout_s: float = DEFAULT_MEDIA_TIMEOUT_S,
    ) -> MediaFiles:
        """An engine's policy: paths only inside ``allowed_dir`` (None: no paths at all)."""
        root = None if allowed_dir is None else Path(os.path.abspath(allowed_dir))
        return cls(allowed_dir=root, max_bytes=max_bytes, timeout_s=timeout_s)

    @property
    def paths_allowed(self) -> bool:
        return self.any_path or self.allowed_dir is not None


def _inside(ref: str, root: Path) -> list[str] | None:
    """The components of ``ref`` below ``root``, or None when it is not lexically inside."""
    if "\x00" in ref or len(ref) > _MAX_PATH_CHARS:
        return None
    path = Path(ref)
    if path.is_absolute():
        try:
            path = path.relative_to(root)
        except ValueError:
            return None
    parts = [p for p in path.parts if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        return None
    return parts


def _open_under(root: Path, parts: list[str]) -> int | None:
    """A descriptor of ``root/parts`` opened without following any symlink, else None."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_bounded(fd: int, files: MediaFiles) -> bytes | None:
    """The whole regular file behind ``fd`` within the cap and the deadline, else None."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > files.max_bytes:
            return None
        deadline = time.monotonic() + files.timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            if time.monotonic() > deadline:
                return None
            chunk = os.read(fd, _CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > files.max_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_media_file(ref: str, files: MediaFiles) -> bytes | None:
    """The bytes of the file ``ref`` names if ``files`` allows reading it, else None.

    None tells the caller only "not a readable allowed file"; it does not say why, so the
    caller's error cannot leak whether the file exists, its size or its type.
    """
    if files.allowed_dir is not None:
        parts = _inside(ref, files.allowed_dir)
        if parts is None:
            return None
        fd = _open_under(files.allowed_dir, parts)
    elif files.any_path:
        if "\x00" in ref or len(ref) > _MAX_PATH_CHARS:
            return None
        try:
            fd = os.open(ref, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError):
            return None
    else:
        return None
    return None if fd is None else _read_bounded(fd, files)
