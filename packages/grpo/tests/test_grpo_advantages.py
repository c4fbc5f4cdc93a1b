"""Group-normalised advantages, token broadcast and whitening: properties and edge cases."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.grpo import GrpoConfigError, GrpoInputError
from posttrain.grpo.advantages import (
    contiguous_group_ids,
    expand_to_tokens,
    group_normalized_advantages,
    whiten_advantages,
)

FAST = settings(max_examples=60, deadline=None)
reward = st.floats(-100, 100, allow_nan=False, width=32)


@st.composite
def grouped_rewards(draw: st.DrawFn) -> tuple[list[float], list[int]]:
    n = draw(st.integers(0, 24))
    rewards = draw(st.lists(reward, min_size=n, max_size=n))
    ids = draw(st.lists(st.integers(-3, 5), min_size=n, max_size=n))
    return rewards, ids


def reference(rewards: list[float], ids: list[int], std_normalize: bool, eps: float) -> list[float]:
    out = []
    for r, g in zip(rewards, ids, strict=True):
        members = [x for x, h in zip(rewards, ids, strict=True) if h == g]
        if min(members) == max(members):
            out.append(0.0)
            continue
        mean = math.fsum(members) / len(members)
        a = r - mean
        if std_normalize and len(members) > 1:
            sd = math.sqrt(math.fsum((x - mean) ** 2 for x in members) / (len(members) - 1))
            if sd > 0:
                a /= sd + eps
        out.append(a)
    return out


@FAST
@given(grouped_rewards(), st.booleans())
def test_matches_the_per_group_reference(data: tuple[list[float], list[int]], norm: bool) -> None:
    rewards, ids = data
    got = group_normalized_advantages(torch.tensor(rewards), ids, std_normalize=norm)
    want = torch.tensor(reference(rewards, ids, norm, 1e-6), dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@FAST
@given(st.lists(reward, min_size=1, max_size=8), st.integers(1, 6), st.booleans())
def test_constant_and_singleton_groups_are_exactly_zero(
    values: list[float], size: int, norm: bool
) -> None:
    # Each value repeated `size` times forms one zero-variance group; size 1 is a singleton.
    rewards = torch.tensor([v for v in values for _ in range(size)])
    ids = contiguous_group_ids(len(rewards), size)
    out = group_normalized_advantages(rewards, ids, std_normalize=norm)
    assert torch.equal(out, torch.zeros_like(out))


def test_zero_variance_is_exact_where_the_mean_would_round() -> None:
    # 0.1 * 3 / 3 != 0.1 in float: the group must still give exact zeros.
    out = group_normalized_advantages(torch.tensor([0.1, 0.1, 0.1]), [7, 7, 7])
    assert out.tolist() == [0.0, 0.0, 0.0]


@FAST
@given(grouped_rewards(), st.randoms(use_true_random=False), st.floats(-50, 50))
def test_permutation_shift_and_relabel_invariance(
    data: tuple[list[float], list[int]], rnd: object, shift: float
) -> None:
    rewards, ids = data
    base = group_normalized_advantages(torch.tensor(rewards), ids)
    perm = list(range(len(rewards)))
    rnd.shuffle(perm)  # type: ignore[attr-defined]
    permuted = group_normalized_advantages(
        torch.tensor([rewards[i] for i in perm]), [ids[i] * 10 + 3 for i in perm]
    )
    torch.testing.assert_close(permuted, base[perm], rtol=1e-5, atol=1e-5)
    shifted = group_normalized_advantages(torch.tensor(rewards, dtype=torch.float64) + shift, ids)
    torch.testing.assert_close(shifted, base, rtol=1e-3, atol=1e-3)


@FAST
@given(st.lists(reward, min_size=2, max_size=10))
def test_normalised_group_has_zero_mean_and_unit_std(values: list[float]) -> None:
    out = group_normalized_advantages(torch.tensor(values), [0] * len(values)).double()
    assert abs(float(out.sum())) < 1e-4
    if min(values) != max(values) and statistics.stdev(values) > 1e-2:
        assert float(out.std()) == pytest.approx(1.0, rel=1e-3)


def test_std_normalisation_off_only_centres() -> None:
    out = group_normalized_advantages(
        torch.tensor([1.0, 3.0, 10.0]), [0, 0, 1], std_normalize=False
    )
    assert out.tolist() == [-1.0, 1.0, 0.0]


def test_detached_no_in_place_and_device_kept() -> None:
    rewards = torch.tensor([1.0, 2.0, 4.0], requires_grad=True)
    before = rewards.detach().clone()
    out = group_normalized_advantages(rewards, torch.tensor([0, 0, 0]))
    assert not out.requires_grad
    assert out.grad_fn is None
    assert torch.equal(rewards.detach(), before)
    assert group_normalized_advantages(torch.zeros(0), []).shape == (0,)


@pytest.mark.parametrize(
    ("rewards", "ids", "match"),
    [
        (torch.tensor([1.0, math.nan]), [0, 0], r"rewards\[1\]"),
        (torch.tensor([1.0, math.inf]), [0, 0], r"rewards\[1\]"),
        (torch.tensor([1.0, 2.0]), [0], "group_ids has 1"),
        (torch.tensor([[1.0]]), [0], "1-D"),
        (torch.tensor([1.0]), torch.tensor([0.5]), "integers"),
        (torch.tensor([1.0]), [True], "integers"),
        (torch.tensor([1.0]), torch.tensor([[0]]), "1-D"),
    ],
)
def test_bad_inputs_are_named(rewards: torch.Tensor, ids: object, match: str) -> None:
    with pytest.raises(GrpoInputError, match=match):
        group_normalized_advantages(rewards, ids)  # type: ignore[arg-type]


def test_bad_eps_and_groups() -> None:
    with pytest.raises(GrpoConfigError, match="eps"):
        group_normalized_advantages(torch.ones(2), [0, 0], eps=-1.0)
    with pytest.raises(GrpoConfigError, match="groups of 3"):
        contiguous_group_ids(4, 3)
    assert contiguous_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]


def test_expand_to_tokens() -> None:
    adv = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    out = expand_to_tokens(adv, [2, 0, 3])
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert out.grad_fn is None
    with pytest.raises(GrpoInputError, match="one per length"):
        expand_to_tokens(adv, [1, 2])
    with pytest.raises(GrpoInputError, match="negative"):
        expand_to_tokens(adv, [1, -1, 2])


@FAST
@given(st.lists(st.tuples(st.floats(-10, 10, width=32), st.booleans()), min_size=1, max_size=30))
def test_whitening_over_masked_tokens(items: list[tuple[float, bool]]) -> None:
    a = torch.tensor([v for v, _ in items])
    mask = torch.tensor([k for _, k in items])
    out = whiten_advantages(a, mask)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    kept = out[mask].double()
    if kept.numel():
        assert abs(float(kept.mean())) < 1e-4
        spread = a[mask].double()
        if kept.numel() > 1 and float(spread.var(unbiased=False)) > 1e-3:
            assert float(kept.var(unbiased=False)) == pytest.approx(1.0, rel=1e-3)
