"""The one NaN/Inf check: ``count_non_finite`` against ``torch.isfinite``, and ``check_finite``."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.formats import check_finite, count_non_finite

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    n=st.integers(1, 64),
    bad=st.lists(st.tuples(st.integers(0, 63), st.sampled_from([math.nan, math.inf, -math.inf]))),
)
def test_the_count_is_isfinite_s(dtype: torch.dtype, n: int, bad: list[tuple[int, float]]) -> None:
    t = torch.linspace(-3, 3, n).to(dtype)
    for i, value in bad:
        t[i % n] = value
    assert count_non_finite(t) == int((~torch.isfinite(t)).sum())


def test_float8_is_widened_and_integers_and_empty_tensors_count_zero() -> None:
    scales = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert count_non_finite(scales) == 0
    scales.view(torch.uint8)[1] = 0x7F  # E4M3's NaN
    assert count_non_finite(scales) == 1
    assert count_non_finite(torch.arange(4)) == 0
    assert count_non_finite(torch.ones(4, dtype=torch.bool)) == 0
    assert count_non_finite(torch.empty(0, 3)) == 0


def test_check_finite_raises_the_callers_error_naming_the_first_bad_tensor() -> None:
    class RefusedError(Exception):
        pass

    good, bad = torch.ones(3), torch.tensor([1.0, math.inf, math.nan])
    check_finite([("good", good)], what="bucket 0", error=RefusedError)
    with pytest.raises(RefusedError, match=r"bucket 0: tensor 'bad' holds 2 non-finite value\(s\)"):
        check_finite(
            [("good", good), ("bad", bad), ("worse", bad)], what="bucket 0", error=RefusedError
        )


def test_a_finite_but_extreme_value_is_refused_with_the_bound_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 35, finding 6: 3e38 is finite but overflows the first matmul."""
    from posttrain.formats import max_abs_weight

    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    t[1, 2] = 3e38
    with pytest.raises(ValueError, match=r"'w' holds a value of magnitude 3e\+38.*1e\+04"):
        check_finite([("w", t)], what="push", error=ValueError)
    check_finite([("w", t)], what="push", error=ValueError, max_abs=float("inf"))
    monkeypatch.setenv("POSTTRAIN_MAX_ABS_WEIGHT", "1e39")
    assert max_abs_weight() == 1e39
    check_finite([("w", t)], what="push", error=ValueError)
    monkeypatch.setenv("POSTTRAIN_MAX_ABS_WEIGHT", "-1")
    with pytest.raises(ValueError, match="POSTTRAIN_MAX_ABS_WEIGHT"):
        max_abs_weight()
