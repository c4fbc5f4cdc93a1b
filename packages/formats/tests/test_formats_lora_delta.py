"""The shared LoRA op: its arithmetic, where the kernel and the collective go, and its dtype."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import lora_delta, matmul_kernel


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """No intra-op thread pool in the pytest process: later tests fork it (an OpenMP pool
    does not survive a fork; forked ranks then hang)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(1, 6),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
    r=st.integers(1, 4),
    scaling=st.floats(0.125, 8.0),
    seed=st.integers(0, 2**16),
)
def test_lora_delta_is_the_peft_arithmetic(
    tokens: int, d_in: int, d_out: int, r: int, scaling: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=gen)
    a = torch.randn(r, d_in, generator=gen)
    b = torch.randn(d_out, r, generator=gen)
    got = lora_delta(x, a, b, scaling)
    assert torch.equal(got, ((x @ a.T) @ b.T) * scaling)


def test_the_kernel_and_the_reduction_are_the_callers() -> None:
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append((tuple(x.shape), tuple(w.shape)))
        return x @ w.T

    x, a, b = torch.ones(3, 5), torch.ones(2, 5), torch.ones(4, 2)
    got = lora_delta(x, a, b, 0.5, linear=kernel, reduce=lambda h: h * 10)
    assert calls == [((3, 5), (2, 5)), ((3, 2), (4, 2))]  # A first, then B
    assert torch.equal(got, torch.full((3, 4), 5 * 10 * 2 * 0.5))


def test_matmul_kernel_computes_in_the_weight_dtype() -> None:
    x = torch.randn(2, 8)
    w = torch.randn(3, 8).to(torch.bfloat16)
    out = matmul_kernel(x, w)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x.to(torch.bfloat16) @ w.T)
