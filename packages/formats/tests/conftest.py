"""Shared test plumbing: the byte corruptions the decoders are fuzzed with."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import strategies as st

Corrupt = Callable[[st.DataObject, bytes], bytes]


def _corrupt(data: st.DataObject, blob: bytes) -> bytes:
    """``blob`` with a few bytes flipped, cut short, or with random bytes spliced in."""
    out = bytearray(blob)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(out) - 1))
            out[at] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        out = out[: data.draw(st.integers(0, len(out) - 1))]
    else:
        at = data.draw(st.integers(0, len(out)))
        out[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    return bytes(out)


@pytest.fixture(scope="session")
def corrupt() -> Corrupt:
    """``corrupt(data, blob)``: a corrupted copy of ``blob``, drawn through hypothesis' ``data``."""
    return _corrupt
