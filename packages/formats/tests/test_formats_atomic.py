"""Atomic writes leave the old content or the new one: after an error, and after SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.formats import (
    AtomicFile,
    atomic_directory,
    replace_directory,
    write_bytes_atomic,
    write_text_atomic,
)
from posttrain.formats import _atomic as atomic_module

_SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class CrashError(Exception):
    pass


def _write_then_crash(f: AtomicFile, part: bytes) -> None:
    with f:
        f.file.write(part)
        f.file.flush()
        raise CrashError


def _fill_then_crash(target: Path) -> None:
    with atomic_directory(target) as staged:
        (staged / "partial").write_bytes(b"x")
        raise CrashError


@_SETTINGS
@given(old=st.binary(max_size=2048), new=st.binary(max_size=2048), cut=st.integers(0, 2048))
def test_file_holds_old_or_new_content(tmp_path: Path, old: bytes, new: bytes, cut: int) -> None:
    path = tmp_path / "f.bin"
    write_bytes_atomic(path, old)
    with pytest.raises(CrashError):
        _write_then_crash(AtomicFile(path), new[:cut])  # dies after writing part of new
    assert path.read_bytes() == old
    write_bytes_atomic(path, new)
    assert path.read_bytes() == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # no temp file left


@_SETTINGS
@given(
    old=st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), st.binary(max_size=64)),
    new=st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), st.binary(max_size=64)),
    fail=st.booleans(),
)
def test_directory_holds_old_or_new_tree(
    tmp_path: Path, old: dict[str, bytes], new: dict[str, bytes], fail: bool
) -> None:
    target = tmp_path / "d"
    with atomic_directory(target) as staged:
        for name, data in old.items():
            (staged / name).write_bytes(data)
    if fail:
        with pytest.raises(CrashError):
            _fill_then_crash(target)
    else:
        with atomic_directory(target) as staged:
            for name, data in new.items():
                (staged / name).write_bytes(data)
    expect = old if fail else new
    assert {p.name: p.read_bytes() for p in target.iterdir()} == expect
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no staging or old tree left


def test_replace_directory_without_rename_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kernels or file systems without RENAME_EXCHANGE take the rename-aside path
    monkeypatch.setattr(atomic_module, "_exchange", lambda a, b: False)
    target = tmp_path / "d"
    for content in (b"one", b"two"):
        staged = tmp_path / ".staged"
        staged.mkdir()
        (staged / "x").write_bytes(content)
        replace_directory(staged, target)
        assert (target / "x").read_bytes() == content
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_replace_directory_over_a_file_and_across_parents(tmp_path: Path) -> None:
    (tmp_path / "t").write_bytes(b"a file")
    staged = tmp_path / ".s"
    staged.mkdir()
    (staged / "y").write_bytes(b"y")
    replace_directory(staged, tmp_path / "t")
    assert (tmp_path / "t" / "y").read_bytes() == b"y"
    elsewhere = tmp_path / "sub"
    elsewhere.mkdir()
    with pytest.raises(ValueError, match="must sit in"):
        replace_directory(elsewhere, tmp_path / "other" / "t")


def test_fixed_temp_name_is_reused_and_text_is_utf8(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    tmp = tmp_path / "state.json.tmp"
    tmp.write_bytes(b"leftover of a killed run")
    write_bytes_atomic(path, b"{}", tmp=tmp)
    assert not tmp.exists()
    write_text_atomic(path, "é\n")
    assert path.read_bytes() == "é\n".encode()
    with pytest.raises(ValueError, match="must sit in"):
        AtomicFile(path, tmp=tmp_path / "sub" / "x.tmp")


def test_failed_commit_leaves_the_target(tmp_path: Path) -> None:
    path = tmp_path / "blocked"
    path.mkdir()  # a directory where the file should go: os.replace refuses
    f = AtomicFile(path)
    f.file.write(b"data")
    with pytest.raises(IsADirectoryError):
        f.commit()
    assert path.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["blocked"]


_WRITER = """
import sys
from pathlib import Path
from posttrain.formats import atomic_directory, write_bytes_atomic
root, kind = Path(sys.argv[1]), sys.argv[2]
for i in range(100_000):
    blob = bytes([i % 2 + 65]) * (1 << 16)  # 64 KiB of 'A' or of 'B'
    if kind == "file":
        write_bytes_atomic(root / "f", blob)
    else:
        with atomic_directory(root / "d") as staged:
            for name in ("one", "two", "three"):
                (staged / name).write_bytes(blob)
    if i == 3:
        print("writing", flush=True)
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["file", "dir"])
def test_sigkill_mid_write_leaves_a_complete_version(tmp_path: Path, kind: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), kind], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"writing\n"  # a few versions are already complete
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    versions = {bytes([65]) * (1 << 16), bytes([66]) * (1 << 16)}
    if kind == "file":
        assert (tmp_path / "f").read_bytes() in versions
    else:
        contents = {(tmp_path / "d" / n).read_bytes() for n in ("one", "two", "three")}
        assert len(contents) == 1
        assert contents <= versions
        assert {p.name for p in (tmp_path / "d").iterdir()} == {"one", "two", "three"}
