"""File-path media under an engine's policy (issue 35, findings 2, 5 and 8): paths off unless
an allowed directory is given; inside it only regular files, no symlinks, no ``..``, a size
cap; every refusal the same words, so an error says nothing about a file; a ``.npy`` header's
shape is bounded by its bytes before anything is allocated."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.models import MediaError, MediaFiles, decode_audio, decode_image, encode_png_base64


def _png(tmp: Path, name: str = "x.png") -> Path:
    pixels = torch.arange(6 * 10 * 3, dtype=torch.uint8).reshape(6, 10, 3)
    path = tmp / name
    path.write_bytes(base64.b64decode(encode_png_base64(pixels)))
    return path


def _refusal(ref: str, files: MediaFiles) -> str:
    with pytest.raises(MediaError) as caught:
        decode_image(ref, files=files)
    return str(caught.value)


def test_without_an_allowed_dir_no_path_is_read_and_the_error_is_the_same(tmp_path: Path) -> None:
    files = MediaFiles.engine(None)
    real = _png(tmp_path)
    hidden = tmp_path / "secret"
    hidden.mkdir(mode=0o700)
    private = _png(hidden, "private.png")
    private.chmod(0o600)
    messages = {_refusal(ref, files) for ref in (str(real), str(private), "/no/such/file.png",
                                                   "/proc/kmsg", str(tmp_path))}  # fmt: skip
    assert len(messages) == 1, messages
    (message,) = messages
    assert "not allowed" in message
    assert "png" not in message
    assert not any(ch.isdigit() for ch in message.replace("base64", ""))  # no size, no dimensions


def test_inside_the_allowed_dir_a_regular_file_is_read(tmp_path: Path) -> None:
    files = MediaFiles.engine(tmp_path)
    path = _png(tmp_path)
    expected = decode_image(str(path)).data
    assert torch.equal(decode_image(str(path), files=files).data, expected)
    assert torch.equal(decode_image("x.png", files=files).data, expected)  # relative to the dir


def test_links_escapes_specials_and_oversize_files_are_refused_alike(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    outside = _png(tmp_path, "outside.png")
    (allowed / "link.png").symlink_to(outside)
    (allowed / "sub").mkdir()
    (allowed / "sublink").symlink_to(tmp_path)
    os.mkfifo(allowed / "pipe.png")
    big = _png(allowed, "big.png")
    files = MediaFiles.engine(allowed, max_bytes=big.stat().st_size - 1)
    refs = [str(allowed / "link.png"), "link.png", "../outside.png", str(outside),
            "sublink/outside.png", str(allowed / "pipe.png"), "sub", str(big),
            "/proc/kmsg", "missing.png"]  # fmt: skip
    messages = {_refusal(ref, files) for ref in refs}
    assert len(messages) == 1, messages
    assert "not allowed" in next(iter(messages))


def test_the_read_has_a_deadline(tmp_path: Path) -> None:
    """A zero-length deadline refuses even a readable file: the loop checks time per chunk."""
    path = _png(tmp_path)
    files = MediaFiles(allowed_dir=tmp_path, timeout_s=1e-9)
    assert "not allowed" in _refusal(str(path), files)


def test_a_npy_header_declaring_a_huge_shape_is_refused_before_allocation() -> None:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "|u1", "fortran_order": False, "shape": (10**12, 8)}
    )
    ref = base64.b64encode(buf.getvalue() + b"\x00" * 16).decode()
    with pytest.raises(
        MediaError, match=r"audio_data: the \.npy header declares shape \[1000000000000, 8\]"
    ):
        decode_audio(ref, num_mel_bins=8)
