"""Untrusted bytes and a hostile file system (issue #18): safetensors headers that lie, JSON
files of the wrong shape, a read-only save dir and a full disk. Each is a named error, exit code 2
from the CLI with one line on stderr, and nothing half-written stays behind; a rerun after the
fault resumes and ends byte-identical to a clean conversion."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import posttrain.formats._atomic as formats_atomic
from posttrain.quant_convert import (
    CheckpointError,
    ConvertOptions,
    OutputError,
    QuantConvertError,
    QuantPolicy,
    ResumeError,
    convert_checkpoint,
)
from posttrain.quant_convert import safetensors_io as sio
from posttrain.quant_convert.cli import main
from posttrain.quant_convert.testing import SyntheticSpec, write_synthetic_checkpoint

SPEC = SyntheticSpec(layers=3, experts=2, shards=3)
OPTS = ConvertOptions(policy=QuantPolicy(num_layers_at_end_in_bf16=1))
FLAGS = ["--num-layers-at-end-in-bf16", "1", "--no-progress"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("ckpt") / "src", SPEC)


@pytest.fixture(scope="module")
def reference(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("ref") / "out"
    convert_checkpoint(src, dst, options=OPTS)
    return dst


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _cli(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["nvfp4", "--model-dir", str(src), "--save-dir", str(dst), *FLAGS])
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("error: ")
    return lines[0]


def _header_file(path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _corrupt_copy(src: Path, dst: Path, shard_bytes: bytes) -> Path:
    shutil.copytree(src, dst)
    first = sorted(dst.glob("*.safetensors"))[0]
    first.write_bytes(shard_bytes)
    return dst


BAD_HEADERS: list[tuple[str, bytes, str]] = [
    ("length 2^40", struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776"),
    ("random bytes", bytes(range(7, 255)) * 3, "not a valid safetensors file"),
    ("shorter than 8 bytes", b"\x01\x02", "shorter than 8 bytes"),
    ("no dtype", b"", "dtype None"),
    ("JSON list", b"", "not an object"),
    ("offsets outside the file", b"", "data_offsets"),
    ("offsets disagree with shape", b"", "needs 8"),
    ("overlapping tensors", b"", "overlap"),
    ("metadata not strings", b"", "__metadata__"),
    ("shape of strings", b"", "shape"),
    ("not UTF-8", struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc", "not JSON"),
]


def _bad_header_bytes(label: str, tmp: Path) -> bytes:
    f = tmp / "h.safetensors"
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    headers: dict[str, Any] = {
        "no dtype": {"w": {"shape": [2], "data_offsets": [0, 8]}},
        "JSON list": [1, 2, 3],
        "offsets outside the file": {"w": {**entry, "data_offsets": [0, 800]}},
        "offsets disagree with shape": {"w": {**entry, "data_offsets": [0, 4]}},
        "overlapping tensors": {"a": entry, "b": {**entry, "data_offsets": [4, 12]}},
        "metadata not strings": {"__metadata__": {"format": 1}, "w": entry},
        "shape of strings": {"w": {**entry, "shape": ["2"]}},
    }
    if label in headers:
        return _header_file(f, headers[label], b"\0" * 16).read_bytes()
    return {b[0]: b[1] for b in BAD_HEADERS}[label]


@pytest.mark.parametrize(("label", "needle"), [(b[0], b[2]) for b in BAD_HEADERS])
def test_a_lying_header_is_a_checkpoint_error_and_exit_2(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], label: str, needle: str
) -> None:
    bad = _corrupt_copy(src, tmp_path / "src", _bad_header_bytes(label, tmp_path))
    shard = sorted(bad.glob("*.safetensors"))[0]
    with pytest.raises(CheckpointError, match=str(shard.name)) as info:
        sio.read_header(shard)
    assert needle in str(info.value)
    code, err = _cli(bad, tmp_path / "out", capsys)
    assert code == 2
    assert needle in _one_line(err)
    assert not (tmp_path / "out").exists()  # refused while planning: nothing written


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("config.json", b"{not json", "not JSON"),
        ("config.json", b"[1, 2]", "not an object"),
        ("config.json", b'{"num_hidden_layers": 3, "text_config": [1]}', ""),
        ("model.safetensors.index.json", b"\xff\xfe", "not JSON"),
        ("model.safetensors.index.json", b'{"weight_map": {"a": "../x"}}', "weight_map"),
        ("model.safetensors.index.json", b'{"weight_map": [1]}', "weight_map"),
    ],
)
def test_malformed_json_sources_are_named(
    src: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: bytes,
    needle: str,
) -> None:
    bad = tmp_path / "src"
    shutil.copytree(src, bad)
    (bad / name).write_bytes(content)
    code, err = _cli(bad, tmp_path / "out", capsys)
    if code == 0:  # a text_config of the wrong type is ignored when the top level has it
        assert not needle
        return
    assert code == 2
    assert needle in _one_line(err)


def test_an_unreadable_state_is_a_resume_error(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / ".quant-convert").mkdir()
    (dst / ".quant-convert" / "state.json").write_text('{"fingerprint": "x", "shards": [1]}')
    with pytest.raises(ResumeError, match="shards"):
        convert_checkpoint(src, dst, options=OPTS)
    (dst / ".quant-convert" / "state.json").write_bytes(b"\x00garbage")
    with pytest.raises(ResumeError, match="not JSON"):
        convert_checkpoint(src, dst, options=OPTS)


# ---- a full disk and a read-only save dir ---------------------------------------------------


class _FullDisk:
    """An ``open`` for the writer that accepts ``budget`` bytes, then fails like a full disk."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def __call__(self, path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)  # noqa: SIM115 - returned to the caller
        if "w" not in mode:
            return f
        disk = self

        class Full:
            def write(self, data: Any) -> int:
                if len(data) > disk.budget:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.budget -= len(data)
                return f.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(f, name)

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: object) -> None:
                f.close()

        return Full()


def test_a_full_disk_is_an_output_error_and_a_rerun_resumes(
    src: Path,
    reference: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dst = tmp_path / "out"
    total = sum(len(b) for b in _files(reference).values())
    # every destination file goes through posttrain.formats' AtomicFile (a fixed temp name)
    monkeypatch.setattr(formats_atomic, "open", _FullDisk(total // 2), raising=False)
    code, err = _cli(src, dst, capsys)
    assert code == 2
    line = _one_line(err)
    assert "No space left on device" in line
    assert str(dst) in line
    assert not list(dst.rglob("*.tmp"))  # nothing half-written
    assert not (dst / "quant_convert_manifest.json").exists()  # never looks complete
    state = json.loads((dst / ".quant-convert" / "state.json").read_text())
    for shard in state["shards"]:  # every shard under its final name is whole
        assert (dst / shard).read_bytes() == (reference / shard).read_bytes()
    monkeypatch.undo()
    report = convert_checkpoint(src, dst, options=OPTS)
    assert set(report.shards_resumed) == set(state["shards"])
    assert _files(dst) == _files(reference)


def test_a_read_only_parent_is_an_output_error(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    os.chmod(parent, 0o500)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("running as root: permissions do not stop writes (see the unshare test)")
        code, err = _cli(src, parent / "out", capsys)
        assert code == 2
        assert "Permission denied" in _one_line(err)
        assert not (parent / "out").exists()
    finally:
        os.chmod(parent, 0o700)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or sys.platform != "linux":
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return probe.returncode == 0


needs_unshare = pytest.mark.skipif(
    not _unshare_works(), reason="needs unshare -rm (user and mount namespaces) to mount"
)


def _in_namespace(script: str, *args: str) -> str:
    """Run ``script`` (sh) in fresh user+mount namespaces, where it may mount; its stdout."""
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


_CONVERT = f"{sys.executable} -m posttrain.quant_convert.cli nvfp4 --no-progress " + " ".join(
    FLAGS[:2]
)


@needs_unshare
@pytest.mark.multiproc
def test_a_real_full_tmpfs_is_an_output_error(src: Path, reference: Path, tmp_path: Path) -> None:
    total = sum(len(b) for b in _files(reference).values())
    mnt = tmp_path / "small"
    mnt.mkdir()
    size_kib = max(8, total // 2 // 1024)
    out = _in_namespace(
        'mount -t tmpfs -o size="$3"k tmpfs "$1" || exit 1; '
        f'{_CONVERT} --model-dir "$2" --save-dir "$1/out" 2>"$1.err"; echo "rc=$?"; '
        'cat "$1.err"; echo "--files"; cd "$1/out" && find . -type f | sort',
        str(mnt),
        str(src),
        str(size_kib),
    )
    head, _, files = out.partition("--files")
    lines = head.strip().splitlines()
    assert lines[0] == "rc=2", out
    assert "No space left on device" in _one_line("\n".join(lines[1:]))
    assert not [f for f in files.split() if f.endswith(".tmp")]
    assert "./quant_convert_manifest.json" not in files.split()


@needs_unshare
@pytest.mark.multiproc
def test_a_read_only_mount_is_an_output_error(src: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    (ro / "out").mkdir(parents=True)
    out = _in_namespace(
        'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" || exit 1; '
        f'{_CONVERT} --model-dir "$2" --save-dir "$1/out" 2>"$1.err"; echo "rc=$?"; '
        'cat "$1.err"; find "$1" -type f | wc -l',
        str(ro),
        str(src),
    )
    lines = out.strip().splitlines()
    assert lines[0] == "rc=2", out
    assert "Read-only file system" in _one_line("\n".join(lines[1:-1]))
    assert lines[-1].strip() == "0"  # nothing written


# ---- fuzzing the header reader ---------------------------------------------------------------

_entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "F4", "", None, 3]),
        "shape": st.lists(st.integers(-2, 6), max_size=3) | st.none() | st.text(max_size=3),
        "data_offsets": st.lists(st.integers(-4, 64), min_size=0, max_size=3) | st.none(),
    },
)
_header = st.dictionaries(
    st.text(max_size=6),
    _entry | st.integers() | st.lists(st.integers(), max_size=2),
    max_size=4,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=_header, data=st.binary(max_size=64), lie=st.none() | st.integers(0, 1 << 64 - 1))
def test_fuzz_structured_headers(
    header: Any, data: bytes, lie: int | None, tmp_path_factory: Any
) -> None:
    f = tmp_path_factory.mktemp("fuzz") / "x.safetensors"
    _header_file(f, header, data, length=lie)
    try:
        entries, _, raw = sio.read_header(f)
    except CheckpointError:
        return
    size = f.stat().st_size
    for e in entries.values():
        assert 8 + len(raw) <= e.begin <= e.end <= size


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=st.binary(max_size=96))
def test_fuzz_arbitrary_bytes(blob: bytes, tmp_path_factory: Any) -> None:
    f = tmp_path_factory.mktemp("fuzz") / "x.safetensors"
    f.write_bytes(blob)
    with contextlib.suppress(QuantConvertError):
        sio.read_header(f)


def test_output_error_is_in_the_error_tree() -> None:
    assert issubclass(OutputError, QuantConvertError)


def test_a_bad_keep_regex_is_one_line_naming_it(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["nvfp4", "--model-dir", str(src), "--save-dir", str(tmp_path / "out"),
            "--extra-high-precision-layers-hf", "re:([", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: keep pattern 're:([' is not a valid regex: ")
    assert not (tmp_path / "out").exists()
