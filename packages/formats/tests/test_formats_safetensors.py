"""The numpy-free safetensors writer: what it writes, the safetensors library reads back."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load

from posttrain.formats import (
    SAFETENSORS_DTYPES,
    safetensors_header,
    tensor_bytes,
    write_safetensors,
)

_DTYPES = sorted(SAFETENSORS_DTYPES, key=str)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 8,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return (raw[: torch.Size(shape).numel()] & 1).bool().reshape(shape)
    return raw[:n].view(dtype).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
        max_size=5,
    ),
    meta=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    seed=st.integers(0, 1000),
)
def test_written_files_read_back_bit_for_bit(
    specs: list[tuple[torch.dtype, list[int]]], meta: dict[str, str], seed: int
) -> None:
    tensors = {f"t{i}": _random(dt, tuple(shape), seed + i) for i, (dt, shape) in enumerate(specs)}
    buf = io.BytesIO()
    write_safetensors(buf, tensors, meta)
    raw = buf.getvalue()
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0  # data starts 8-byte aligned
    back = load(raw)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype
        assert back[name].shape == t.shape
        assert bytes(tensor_bytes(back[name])) == bytes(tensor_bytes(t))


def test_metadata_views_and_header_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous
    with open(tmp_path / "x.safetensors", "wb") as f:
        write_safetensors(f, {"x": t, "s": torch.tensor(2.5)}, {"format": "pt"})
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor("x"), t)
        assert f.get_tensor("s").item() == 2.5
    head, sizes = safetensors_header([("a", "BF16", (2, 3)), ("b", "U8", ())])
    assert sizes == [12, 1]
    assert head[8:].rstrip(b" ").endswith(b'"data_offsets":[12,13]}}')
    with pytest.raises(ValueError, match="not a safetensors dtype"):
        safetensors_header([("a", "F4", (2,))])
    with pytest.raises(ValueError, match="named twice"):
        safetensors_header([("a", "U8", (1,)), ("a", "U8", (1,))])
    with pytest.raises(ValueError, match="no safetensors name"):
        write_safetensors(io.BytesIO(), {"c": torch.zeros(1, dtype=torch.complex64)})
