"""Atomic writes: a file or a whole directory appears complete, or not at all.

Every posttrain package that writes something another process (or a later run) reads goes
through here: write under a temp name in the same directory, ``fsync`` the data, rename over
the target, then ``fsync`` the directory so that the rename itself survives a power loss.
Readers therefore see the old content or the new one, never a mix or a torn file.

Where this departs from the obvious:

* Replacing a directory that exists swaps the two trees in one ``renameat2(RENAME_EXCHANGE)``
  call (Linux >= 3.15, on the file systems that support it), so there is no moment without a
  target. Where the call is missing or refused, the old tree is renamed aside first; a crash
  in that short window leaves the old tree under ``.<name>.old-<pid>`` and no target.
* A file's temp name is unique by default; a caller that resumes after a crash (the NVFP4
  converter) may pass a fixed ``tmp`` path, so that a rerun overwrites its own leftover
  instead of leaving one behind per attempt.
* Errors are the operating system's ``OSError``: the caller knows what the file was for and
  maps it to its own error; the target is never touched by a write that failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "AtomicFile",
    "atomic_directory",
    "fsync_dir",
    "fsync_tree",
    "replace_directory",
    "write_bytes_atomic",
    "write_text_atomic",
]

StrPath = str | os.PathLike[str]


def fsync_dir(path: StrPath) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: StrPath) -> None:
    """fsync every file below ``root``, then every directory, deepest first, ``root`` last."""
    for parent, dirs, files in os.walk(root, topdown=False):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for name in dirs:
            fsync_dir(os.path.join(parent, name))
    fsync_dir(root)


class AtomicFile:
    """A file written under a temp name; :meth:`commit` renames it over ``path`` durably.

    As a context manager it commits on a clean exit and discards the temp file when the
    block raises, leaving ``path`` as it was. ``file`` is the open binary file to write to.
    """

    def __init__(self, path: StrPath, *, tmp: StrPath | None = None) -> None:
        self.path = Path(path)
        if tmp is None:
            fd, name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            self.tmp = Path(name)
            self.file: BinaryIO = os.fdopen(fd, "wb")
        else:
            self.tmp = Path(tmp)
            if self.tmp.parent.resolve() != self.path.parent.resolve():
                raise ValueError(f"{self.tmp}: the temp file must sit in {self.path.parent}")
            self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit()/discard()

    def commit(self) -> None:
        """fsync the data, rename the temp file over ``path``, fsync the directory."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Close and remove the temp file; ``path`` keeps whatever it held.

        Closing may itself fail (a full disk fails the final flush): the temp file is removed
        all the same, so nothing half-written stays behind.
        """
        try:
            with contextlib.suppress(OSError):
                self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_bytes_atomic(path: StrPath, data: bytes, *, tmp: StrPath | None = None) -> None:
    """Replace ``path`` with ``data`` atomically (temp name, fsync, rename, fsync dir)."""
    with AtomicFile(path, tmp=tmp) as f:
        f.file.write(data)


def write_text_atomic(path: StrPath, text: str, *, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically (see :func:`write_bytes_atomic`)."""
    write_bytes_atomic(path, text.encode(encoding))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False where the kernel or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without the wrapper (glibc < 2.28, musl)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def replace_directory(staged: StrPath, target: StrPath) -> None:
    """Make the complete tree ``staged`` appear as ``target`` (replacing any old one) durably.

    Everything below ``staged`` is fsynced first. ``staged`` must sit in ``target``'s parent
    (a rename never crosses file systems). Afterwards ``staged`` no longer exists.
    """
    staged, target = Path(staged), Path(target)
    if staged.parent.resolve() != target.parent.resolve():
        raise ValueError(f"{staged}: a staged directory must sit in {target.parent}")
    fsync_tree(staged)
    if not target.exists():
        os.rename(staged, target)
        fsync_dir(target.parent)
        return
    if _exchange(staged, target):
        fsync_dir(target.parent)
        _remove(staged)  # now the old target
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.rename(target, old)
    os.rename(staged, target)
    fsync_dir(target.parent)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextlib.contextmanager
def atomic_directory(target: StrPath) -> Iterator[Path]:
    """Yield an empty temp directory beside ``target``; on a clean exit it replaces ``target``.

    When the block raises, the temp directory is removed and ``target`` keeps what it held.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staged
        replace_directory(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
